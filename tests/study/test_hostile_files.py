"""Hostile files get clean refusals: crafted model bundles and model files, terminal
escapes in names, spreadsheet formulas in the scores CSV, a PNG decompression bomb.

Every file here is real (written to disk, read by the product's own readers and CLI
commands); each test is named after the attack and checks the refusal names the file
and the field, and that nothing raw (a Python exception, an escape sequence, a
formula) gets through.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load, save

from common.commands.cli import main_with
from common.commands.study import register as register_study
from common.core.errors import ConfigError, DataError, StateError, ValidationError
from common.core.modelfile import MAGIC, ModelFile, flat_layout, read_model_file, write_model_file
from common.core.text import csv_cell, printable
from common.releases.bundle import ModelBundle, bundle_bytes, read_bundle, write_bundle
from common.study import load_study
from site_agent.imaging import MAX_IMAGE_PIXELS, ImageSpec, load_image_folder
from site_agent.predict_cli import register_model, register_predict
from tests.study.helpers import COLUMNS, study_toml, trained_bundle, write_hospital_csv

ESC = "\x1b"
# Clear the screen, retitle the terminal, and an OSC 8 link whose text hides its target.
ESCAPES = f"{ESC}[2J{ESC}]0;pwned\x07{ESC}]8;;https://evil.example{ESC}\\click{ESC}]8;;{ESC}\\"
DEEP = "[" * 100_000 + "]" * 100_000


def run(argv: list[str]) -> int:
    return main_with([register_model, register_predict, register_study], argv)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> ModelBundle:
    path = write_hospital_csv(tmp_path_factory.mktemp("hostile") / "train.csv", n_patients=60)
    return trained_bundle(path, steps=20)  # type: ignore[no-any-return]


def _metadata(data: bytes) -> dict[str, str]:
    length = int.from_bytes(data[:8], "little")
    return dict(json.loads(data[8 : 8 + length])["__metadata__"])


def _crafted(bundle: ModelBundle, **edits: str) -> bytes:
    """The bundle with metadata values replaced and its digest recomputed, as an
    attacker who edits the file would (the digest is not a signature)."""
    from common.core.tensor_file import metadata_digest

    data = bundle_bytes(bundle)
    tensors = load(data)
    metadata = {**_metadata(data), **edits}
    ordered = {name: tensors[name] for name in bundle.parameters}
    metadata["medfed.sha256"] = metadata_digest(metadata, ordered)
    return save(tensors, metadata=metadata)  # type: ignore[no-any-return]


def _raw_header(header: bytes) -> bytes:
    """A safetensors file of just `header` (length-prefixed), no tensors."""
    return len(header).to_bytes(8, "little") + header


# --------------------------------------------------------------- crafted bundles


def test_deeply_nested_bundle_header_is_refused_naming_the_file(tmp_path: Path) -> None:
    """100,000 nested arrays: json.loads raises RecursionError; the reader refuses the
    file instead."""
    path = tmp_path / "deep.safetensors"
    path.write_bytes(_raw_header(b'{"__metadata__":' + DEEP.encode() + b"}"))
    with pytest.raises(ValidationError, match=r"deep\.safetensors.*header is not JSON"):
        read_bundle(path)


@pytest.mark.parametrize(
    ("key", "words"),
    [
        ("medfed.study", r"medfed\.study: study is not UTF-8 JSON"),
        ("medfed.parameters", r"medfed\.parameters: .*not JSON"),
        ("medfed.statistics", r"medfed\.statistics: .*recursion limit"),
        ("medfed.threshold", r"medfed\.threshold: .*recursion limit"),
        ("medfed.architecture", r"medfed\.architecture: .*recursion limit"),
        ("medfed.privacy_card", r"medfed\.privacy_card: .*recursion limit"),
    ],
)
def test_deeply_nested_metadata_value_is_refused_naming_the_key(
    tmp_path: Path, bundle: ModelBundle, key: str, words: str
) -> None:
    path = tmp_path / "nested.safetensors"
    path.write_bytes(_crafted(bundle, **{key: DEEP}))
    with pytest.raises(ValidationError, match=r"nested\.safetensors: " + words):
        read_bundle(path)


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        # "²".isdigit() is True, int("²") a ValueError.
        ("medfed.round", "²", r"medfed\.round: must be a non-negative integer"),
        ("medfed.round", "٣", r"medfed\.round: must be a non-negative integer"),
        # Beyond int()'s 4,300-digit limit (a ValueError from int()).
        ("medfed.round", "9" * 5000, r"medfed\.round: must be a non-negative integer"),
        ("medfed.parameters", '[{"name":"x","shape":[' + "9" * 5000 + "]}]",
         r"medfed\.parameters: .*not JSON"),
        ("medfed.parameters", '[{"name":"x","shape":[1e400]}]',
         r"medfed\.parameters: shape of 'x'"),
        ("medfed.parameters", '[{"name":"x","shape":["12"]}]',
         r"medfed\.parameters: shape of 'x'"),
        ("medfed.parameters", '[{"name":"x","shape":[-1]}]',
         r"medfed\.parameters: shape of 'x'"),
        ("medfed.parameters", "[null]", r"medfed\.parameters: .*entry 0"),
        ("medfed.threshold", '{"histogram_bins":' + "9" * 5000 + "}",
         r"medfed\.threshold: .*number out of range"),
    ],
)
def test_crafted_numbers_are_refused_naming_the_key(
    tmp_path: Path, bundle: ModelBundle, key: str, value: str, words: str
) -> None:
    path = tmp_path / "numbers.safetensors"
    path.write_bytes(_crafted(bundle, **{key: value}))
    with pytest.raises(ValidationError, match=r"numbers\.safetensors: " + words):
        read_bundle(path)


def test_study_with_terminal_escapes_in_a_feature_name_is_refused_and_shown_escaped(
    tmp_path: Path, bundle: ModelBundle, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bundle whose study names a feature with escape sequences (digest recomputed):
    refused as a study no `study check` would pass, and the error line on the terminal
    carries the escapes as text, not as control characters."""
    metadata = _metadata(bundle_bytes(bundle))
    study = json.loads(metadata["medfed.study"])
    study["features"][0]["name"] = "Age" + ESCAPES
    canonical = json.dumps(study, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    path = tmp_path / "escapes.safetensors"
    path.write_bytes(_crafted(bundle, **{"medfed.study": canonical}))
    with pytest.raises(ValidationError, match=r"medfed\.study: .*features\[0\]\.name"):
        read_bundle(path)
    assert run(["model", "show", "--model", str(path)]) == 2
    captured = capsys.readouterr()
    assert "escapes.safetensors" in captured.err and "features[0].name" in captured.err
    assert ESC not in captured.err + captured.out and "\x07" not in captured.err
    assert "\\x1b[2J" in captured.err


def test_model_show_prints_names_from_the_file_escaped(
    tmp_path: Path, bundle: ModelBundle, capsys: pytest.CaptureFixture[str]
) -> None:
    """Fields a study check does not govern (a site's name in the privacy card, a note,
    the statistics source) hold escapes and a right-to-left override: `model show`
    prints every one escaped, `--json` as JSON escapes."""
    site = bundle.card.sites[0].model_copy(update={"site": "evil\u202egnp.exe" + f"{ESC}[2J"})
    card = bundle.card.model_copy(
        update={"sites": (site, *bundle.card.sites[1:]), "notes": ("note" + ESCAPES,)}
    )
    statistics = bundle.statistics.model_copy(update={"source": "release" + ESCAPES})
    path = tmp_path / "names.safetensors"
    write_bundle(path, dataclasses.replace(bundle, card=card, statistics=statistics))
    assert run(["model", "show", "--model", str(path)]) == 0
    out = capsys.readouterr().out
    assert ESC not in out and "\x07" not in out and "\u202e" not in out
    assert "site evil\\u202egnp.exe\\x1b[2J:" in out
    assert "note: note\\x1b[2J\\x1b]0;pwned\\x07\\x1b]8;;https://evil.example" in out
    assert "preprocessing statistics: release\\x1b[2J" in out
    assert run(["model", "show", "--model", str(path), "--json"]) == 0
    shown = capsys.readouterr().out
    assert ESC not in shown and "\u202e" not in shown
    assert json.loads(shown)["privacy"]["sites"][0]["site"] == "evil\u202egnp.exe" + f"{ESC}[2J"


# --------------------------------------------------------------- crafted model files


def _model_file(tmp_path: Path, header: dict[str, Any] | bytes, body: bytes = b"") -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path = tmp_path / "init.model"
    path.write_bytes(MAGIC + len(raw).to_bytes(4, "big") + raw + body)
    return path


def test_crafted_model_file_headers_are_refused_naming_the_file(tmp_path: Path) -> None:
    """The coordinator's initial model and checkpoints: nested headers, "²" and 5,000
    digits as extras counts, extras that are not a list."""
    good = tmp_path / "good.model"
    write_model_file(good, ModelFile(flat_layout(3), np.ones(3, dtype=np.float32),
                                     extras={"m": np.zeros(2, dtype=np.float32)}))
    data = good.read_bytes()
    length = int.from_bytes(data[8:12], "big")
    header = json.loads(data[12 : 12 + length])
    body = data[12 + length :]
    assert read_model_file(good).extras["m"].shape == (2,)
    cases: list[tuple[dict[str, Any] | bytes, str]] = [
        (b'{"format":1,"layout":' + DEEP.encode() + b"}", "header is not JSON"),
        ({**header, "extras": [{"name": "m", "elements": "²"}]}, "extras entry 0"),
        ({**header, "extras": [{"name": "m", "elements": "9" * 5000}]}, "extras entry 0"),
        (json.dumps({**header, "extras": []})[:-1].encode() + b',"n":' + b"9" * 5000 + b"}",
         "header is not JSON"),
        ({**header, "extras": [{"name": "m"}]}, "extras entry 0"),
        ({**header, "extras": 7}, "extras must be a list"),
        ({**header, "extras": [{"name": "m", "elements": -1}]}, "extras entry 0"),
        ({**header, "layout": [{"name": "f", "dtype": "<f4", "shape": [1.5]}]},
         "layout entry 0: shape"),
    ]
    for crafted, words in cases:
        path = _model_file(tmp_path, crafted, body)
        with pytest.raises(StateError, match=f"model file {path} is invalid: .*{words}"):
            read_model_file(path)


# --------------------------------------------------------------- CSV injection


FORMULAS = ["=HYPERLINK(\"https://evil.example\",\"x\")", "@SUM(A1:A9)", "=1+1", "+1+1",
            "-2+3"]  # the data loader strips surrounding whitespace (tab, CR)


def test_scores_csv_neutralises_formula_patient_ids(
    tmp_path: Path, bundle: ModelBundle, capsys: pytest.CaptureFixture[str]
) -> None:
    """Patient ids are data, not code: a scores CSV opened in a spreadsheet must not run
    `=HYPERLINK(...)`, `@SUM(...)` or `=1+1` from them (OWASP CSV injection)."""
    model = tmp_path / "model.safetensors"
    write_bundle(model, bundle)
    data = tmp_path / "new.csv"
    rows = list(csv.reader(write_hospital_csv(tmp_path / "h.csv", n_patients=6, seed=5)
                           .read_text(encoding="utf-8").splitlines()))
    for row, formula in zip(rows[1:], FORMULAS + ["H-plain"] * 12, strict=False):
        row[0] = formula
    with data.open("w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows(rows)
    out = tmp_path / "scores.csv"
    assert run(["predict", "--model", str(model), "--data", str(data), "--out", str(out)]) == 0
    capsys.readouterr()
    with out.open(newline="", encoding="utf-8") as handle:
        scores = list(csv.reader(handle))
    assert scores[0] == ["row", COLUMNS[0], "score", "prediction"]
    ids = [record[1] for record in scores[1:]]
    assert ids[: len(FORMULAS)] == ["'" + f for f in FORMULAS]
    assert set(ids[len(FORMULAS) :]) == {"H-plain"}  # an ordinary id is left alone
    # No cell of the file starts a formula; the scores stay plain numbers.
    cells = [cell for record in scores for cell in record]
    assert not [c for c in cells if c.startswith(("=", "+", "-", "@", "\t", "\r"))]
    assert all(0.0 <= float(record[2]) <= 1.0 for record in scores[1:])


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        ({"classes": ["no", "=HYPERLINK(\"https://evil.example\")"]}, "study.classes"),
        ({"classes": ["no", "@SUM(A1)"]}, "study.classes"),
        ({"classes": ["no", "yes" + ESC + "[2J"]}, "study.classes"),
        ({"label_column": "=1+1"}, "data.label_column"),
        ({"patient_column": "@cmd"}, "data.patient_column"),
        ({"patient_column": "Patient" + ESC + "]0;x\x07"}, "data.patient_column"),
        ({"feature": "+SUM(1)"}, "features[0].name"),
        ({"feature": "Age\u202e"}, "features[0].name"),
    ],
)
def test_study_check_refuses_formula_and_control_character_names(
    tmp_path: Path, edit: dict[str, Any], field: str, capsys: pytest.CaptureFixture[str]
) -> None:
    text = study_toml("hostile", rounds=2)
    if "classes" in edit:
        text = text.replace('classes = ["no", "yes"]', f"classes = {json.dumps(edit['classes'])}")
    elif "label_column" in edit:
        text = text.replace('label_column = "Outcome"',
                            f"label_column = {json.dumps(edit['label_column'])}")
    elif "patient_column" in edit:
        text = text.replace('patient_column = "Patient-ID"',
                            f"patient_column = {json.dumps(edit['patient_column'])}")
    else:
        text = text.replace('name = "Age (years)"', f"name = {json.dumps(edit['feature'])}")
    path = tmp_path / "study.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as refused:
        load_study(path)
    assert refused.value.field == field
    assert run(["study", "check", "--study", str(path)]) == 2
    err = capsys.readouterr().err
    assert field in err and str(path) in err and ESC not in err and "\u202e" not in err


def test_study_check_keeps_real_column_names(tmp_path: Path) -> None:
    """The control: names as real datasets write them still pass."""
    text = study_toml("real-names", rounds=2)
    for old, new in [("Age (years)", "Age (years)"), ("Sex", "sex.M"),
                     ("Lactate mmol/L", "time_to_event"), ("Admission type", "Âge à l'entrée")]:
        text = text.replace(f'name = "{old}"', f'name = "{new}"')
    text = text.replace('classes = ["no", "yes"]', 'classes = ["-1", "+1 (alive)"]')
    path = tmp_path / "study.toml"
    path.write_text(text.replace('"-1", "+1 (alive)"', '"-1", "1 (alive)"'), encoding="utf-8")
    study = load_study(path)
    assert [f.name for f in study.features] == [
        "Age (years)", "sex.M", "time_to_event", "Âge à l'entrée"]
    assert study.study.classes == ("-1", "1 (alive)")


def test_text_helpers() -> None:
    assert printable("Âge (années) 年齢") == "Âge (années) 年齢"
    assert printable(f"a{ESC}[2Jb\u202ec\u2028") == "a\\x1b[2Jb\\u202ec\\u2028"
    assert printable("line\nnext", keep="\n") == "line\nnext"
    assert [csv_cell(v) for v in ("=1+1", "-x", "ok", -1, 0.5)] == ["'=1+1", "'-x", "ok", -1, 0.5]


# --------------------------------------------------------------- decompression bomb


def _png(width: int, height: int) -> bytes:
    """A real 8-bit greyscale PNG of zeros: IDAT streamed through zlib, so a
    14000 x 14000 bomb (196 MB of pixels) is a file under 1 MB."""

    def chunk(tag: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(tag + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", crc)

    compressor = zlib.compressobj(1)
    rows = bytes(width + 1) * 100
    parts = [compressor.compress(rows) for _ in range(height // 100)]
    parts.append(compressor.compress(bytes(width + 1) * (height % 100)))
    parts.append(compressor.flush())
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", b"".join(parts))
            + chunk(b"IEND", b""))


def _folder(root: Path, image: bytes, name: str) -> Path:
    root.mkdir()
    ok = io.BytesIO()
    from PIL import Image

    Image.fromarray(np.zeros((8, 8), dtype=np.uint8)).save(ok, format="PNG")
    (root / "ok.png").write_bytes(ok.getvalue())
    (root / name).write_bytes(image)
    (root / "labels.csv").write_text(f"file,label\nok.png,0\n{name},1\n", encoding="utf-8")
    return root


SPEC = ImageSpec(image_size=8, channels=1, classes=("0", "1"))


@pytest.mark.parametrize(
    ("width", "height", "words"),
    [
        # Past twice Pillow's limit: Image.open itself raises DecompressionBombError.
        (14000, 14000, "could be decompression bomb"),
        # Between Pillow's warning and its error: refused from the header by medfed.
        (10000, 9000, f"more than the {MAX_IMAGE_PIXELS} allowed"),
    ],
)
def test_png_decompression_bomb_is_a_data_error_naming_the_file(
    tmp_path: Path, width: int, height: int, words: str
) -> None:
    data = _png(width, height)
    assert len(data) < 2_000_000 and width * height > MAX_IMAGE_PIXELS
    folder = _folder(tmp_path / "images", data, "bomb.png")
    with pytest.raises(DataError, match=words) as refused:
        load_image_folder(folder, SPEC)
    assert refused.value.file == str(folder / "bomb.png")
    # The decode path (headers not checked at open) refuses it the same way.
    dataset = load_image_folder(folder, SPEC, check_headers=False)
    bomb = [i for i, e in enumerate(dataset.entries) if Path(e.path).name == "bomb.png"]
    with pytest.raises(DataError, match=words) as decoded:
        dataset.image(bomb[0])
    assert decoded.value.file == str(folder / "bomb.png")


def test_broken_png_stream_is_a_data_error_naming_the_file(tmp_path: Path) -> None:
    good = _png(16, 16)
    broken = bytearray(good)
    broken[-20] ^= 0xFF  # inside the IDAT stream
    folder = _folder(tmp_path / "images", bytes(broken), "broken.png")
    dataset = load_image_folder(folder, SPEC)
    index = next(i for i, e in enumerate(dataset.entries) if Path(e.path).name == "broken.png")
    with pytest.raises(DataError, match="unreadable image") as refused:
        dataset.image(index)
    assert refused.value.file == str(folder / "broken.png")
