"""No preprocessing is fitted on a hospital's private data without DP, on any path that
reaches the federation.

What a site derives from its data before training, and where each comes from:

* scaler (mean, scale), numeric imputation value, clip range: `GlobalStatistics`, the
  federated DP statistics release (on every site's ledger, `common.releases.statistics`), or the
  study's declared `range`;
* categorical vocabulary: the study's declared `levels` (a level not declared is a data
  error, never a new column); its imputation level: `GlobalStatistics` (DP);
* bin edges: the statistics release's auto ranges are read from its own DP histogram;
  the evaluation histogram's buckets from the public model's probe and the previous
  round's released (DP) histogram; a query's bins are declared in the query file;
* the held-out split: a keyed hash of each unit's own id (tests/privacy/
  test_attack_split_neighbours.py), not fitted.

This file walks the code (every call that fits a scaler from data, and what imports it)
and checks the behaviour: a site's encoding of a record is a function of that record and
public values alone, so adding an extreme patient to the file changes no other record's
encoding and no encoding parameter.
"""

from __future__ import annotations

import ast
import csv
import functools
from pathlib import Path

import numpy as np

from site_agent.data import Preprocessor, load_study_table
from tests.study.helpers import (
    COLUMNS,
    hospital_rows,
    hospital_study,
    noiseless_statistics,
)

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("common", "coordinator", "site_agent", "demo")

# Every product function that fits preprocessing on a table without noise (calls a
# `.fit(...)` or `prepare_site_split`), with why it never reaches the federation. A new
# one fails this test until it is a DP release or listed here with its reason.
LOCAL_ONLY_FITS = {
    "site_agent/data.py:prepare_site_split": "split + noiseless scaler for the local-only "
    "tools below; the round path encodes with `Preprocessor` and the DP statistics",
    "site_agent/baselines.py:centralized_nodp": "the centralized non-private "
    "comparison the demo and bench print beside the DP model; sent nowhere",
    "site_agent/baselines.py:federated_nodp": "the federated non-private comparison, "
    "run in one process over the sites' files (demo, bench); sent nowhere",
    "site_agent/audit.py:run_audit": "the one-run privacy audit trains a local model with "
    "canaries on the site's machine; only its epsilon estimate is printed",
    "site_agent/distributed_train.py:_site_data_and_model": "torchrun multi-GPU training "
    "benchmark at one hospital; writes weights to a local folder, joins no federation",
}
LOCAL_ONLY_FILES = {key.split(":")[0] for key in LOCAL_ONLY_FITS} - {"site_agent/data.py"}
FIT_CALLS = {"fit", "prepare_site_split"}


def module_path(name: str) -> Path | None:
    path = ROOT / (name.replace(".", "/") + ".py")
    if path.exists():
        return path
    package = ROOT / name.replace(".", "/") / "__init__.py"
    return package if package.exists() else None


@functools.cache
def imported_modules(path: Path) -> frozenset[str]:
    """Every product module `path` imports, at module level or inside functions (each
    file parsed once: the closures of several roots share most of their files)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return frozenset(n for n in names
                     if n.split(".")[0] in PRODUCT and module_path(n) is not None)


def closure(root: str) -> set[Path]:
    """The product files `root` can reach through imports (its import closure)."""
    seen: set[Path] = set()
    todo = [root]
    while todo:
        path = module_path(todo.pop())
        if path is None or path in seen:
            continue
        seen.add(path)
        todo.extend(imported_modules(path))
    return seen


def fitting_functions() -> dict[str, list[int]]:
    """"file:function" of every product function calling `<x>.fit(...)` or
    `prepare_site_split(...)` (module level: "file:<module>")."""
    found: dict[str, list[int]] = {}
    for package in PRODUCT:
        for path in (ROOT / package).rglob("*.py"):
            if "proto" in path.parts:
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"))
            owner = {}
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    for inner in ast.walk(node):
                        owner.setdefault(id(inner), node.name)
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call):
                    continue
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else (
                    func.id if isinstance(func, ast.Name) else "")
                if name in FIT_CALLS:
                    where = f"{path.relative_to(ROOT)}:{owner.get(id(node), '<module>')}"
                    found.setdefault(where, []).append(node.lineno)
    return found


def test_every_noiseless_fit_is_listed_with_why_it_never_leaves_the_site() -> None:
    assert set(fitting_functions()) == set(LOCAL_ONLY_FITS)


def test_no_round_path_module_reaches_a_noiseless_fit() -> None:
    """The site agent (every round it takes part in), the coordinator and the demo's
    federation never import a module that fits on private data without noise."""
    local_only = {ROOT / name for name in LOCAL_ONLY_FILES}
    for root in ("site_agent.agent", "site_agent.releases", "coordinator.engine"):
        reached = closure(root)
        assert len(reached) > 5, root  # the walk follows imports
        assert not reached & local_only, (root, sorted(map(str, reached & local_only)))


def write_csv(path: Path, rows: list[list[str]]) -> Path:
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(COLUMNS)
        writer.writerows(rows)
    return path


def test_one_added_patient_changes_no_other_record_encoding(tmp_path: Path) -> None:
    """The encoding is per record: with the federation's (public) statistics fixed, a
    file with one extreme patient more encodes every other record exactly as before, and
    the encoder's parameters do not move. A fit on the file (the old no-study path's
    `Standardizer.fit`) would shift every record's scaled values."""
    study = hospital_study()
    rows = hospital_rows(80, seed=3)
    extreme = [["H3-99999", "94", "M", "9999.00", "transfer", "yes"],
               ["H3-99999", "94", "M", "", "NA", "yes"]]
    before = load_study_table(write_csv(tmp_path / "before.csv", rows), study)
    after = load_study_table(write_csv(tmp_path / "after.csv", rows + extreme), study)
    # Stand-in for the DP release's output: any public values will do (this test is
    # about what the site does with them, not how they were released).
    statistics = noiseless_statistics(study, before)
    encoder_before = Preprocessor(study, statistics)
    encoder_after = Preprocessor(study, statistics)
    assert encoder_before.feature_names() == encoder_after.feature_names()
    encoded_before = encoder_before.transform(before)
    encoded_after = encoder_after.transform(after)
    assert encoded_after.shape == (encoded_before.shape[0] + 2, encoded_before.shape[1])
    np.testing.assert_array_equal(encoded_after[: len(before)], encoded_before)
    # The extreme value is clipped into the public range, not allowed to set it.
    lactate = encoder_after.feature_names().index("Lactate mmol/L")
    stats = statistics.numeric["Lactate mmol/L"]
    assert encoded_after[len(before), lactate] == np.float32(
        (stats.clip_high - stats.mean) / stats.scale)
    # Contrast: a noiseless fit on the file moves every record when one patient is added.
    from site_agent.data import Standardizer

    fitted_before = Standardizer.fit(encoded_before)
    raw_after = np.vstack([encoded_before, encoded_after[len(before):]])
    fitted_after = Standardizer.fit(raw_after)
    assert not np.allclose(fitted_before.mean, fitted_after.mean)


def test_one_added_image_changes_no_other_image_as_loaded(tmp_path: Path) -> None:
    """Images: each is decoded, windowed and resized on its own (no folder-wide mean or
    scale): a folder with one saturated image more loads every other image to the same
    tensor."""
    from PIL import Image

    from site_agent.imaging import ImageSpec, load_image_folder
    from site_agent.synthetic_imaging import write_site_folder

    folder = write_site_folder(tmp_path / "cohort", "st_marys", seed=2, patients=12)
    spec = ImageSpec(image_size=16, patient_column="patient_id")
    before = load_image_folder(folder, spec)
    tensors_before = before.load(np.arange(len(before))).numpy()
    labels = folder / "labels.csv"
    lines = labels.read_text(encoding="utf-8").splitlines()
    header = lines[0].split(",")
    first = lines[1].split(",")
    Image.new("L", (64, 64), color=255).save(folder / "zz-white.png")
    added = ",".join("zz-white.png" if i == 0 else "zz-new"
                     if header[i] == "patient_id" else v for i, v in enumerate(first))
    labels.write_text("\n".join([*lines, added]) + "\n", encoding="utf-8")
    after = load_image_folder(folder, spec)
    assert len(after) == len(before) + 1
    tensors_after = after.load(np.arange(len(after))).numpy()
    by_file_before = dict(zip((str(e.path) for e in before.entries), tensors_before, strict=True))
    by_file_after = dict(zip((str(e.path) for e in after.entries), tensors_after, strict=True))
    assert set(by_file_after) - set(by_file_before) == {str(folder / "zz-white.png")}
    for name, tensor in by_file_before.items():
        np.testing.assert_array_equal(by_file_after[name], tensor)
