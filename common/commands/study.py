"""``medfed study``: draft a study file from column names, and check one.

``study init`` reads at most a CSV header line (or a Parquet schema): never a data
value, so it can run anywhere without touching patient data. Registered through the
``medfed.commands`` entry point (``study``).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common.commands.cli import main_with
from common.core.config import SERVER_OPTIMIZERS
from common.core.errors import ConfigError, PkiError
from common.core.parsing import parse_toml
from common.models import model_names
from common.protocol import pki
from common.study import (
    ModelSection,
    Study,
    encoded_feature_names,
    intermediaries_warning,
    load_study,
    study_from_mapping,
    study_sha256,
)

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def register(subparsers: Any) -> None:
    """Add ``medfed study {init,check}``."""
    parser = subparsers.add_parser(
        "study",
        help="draft and check a study file (what the federation trains)",
        description="A study file names the features, label, model, training settings and "
        "privacy requests of one federation. Every site checks its data against it.",
    )
    actions = parser.add_subparsers(dest="study_command", metavar="ACTION", required=True)

    init = actions.add_parser(
        "init",
        help="draft study.toml from column names (reads a header line, never data values)",
    )
    init.add_argument("--out", required=True, type=Path, help="study file to write (new)")
    init.add_argument("--label-column", required=True)
    init.add_argument("--patient-column", help="patient id column (patient-level DP)")
    source = init.add_mutually_exclusive_group(required=True)
    source.add_argument("--features", help="comma-separated feature columns")
    source.add_argument(
        "--header-from",
        type=Path,
        metavar="FILE",
        help="CSV (header line only) or Parquet (schema only); default features: every "
        "column except label and patient id",
    )
    init.add_argument(
        "--categorical",
        action="append",
        default=[],
        metavar="COL=L1,L2,...",
        help="a categorical feature and its levels as written in the file (repeatable)",
    )
    init.add_argument(
        "--missing",
        choices=["error", "impute", "indicator"],
        default="error",
        help="missing-value policy written for every feature (edit per feature later)",
    )
    init.add_argument("--name", default="study", help="study name")
    init.add_argument("--rounds", type=int, default=10)
    init.add_argument(
        "--classes",
        default="0,1",
        help="labels as written in the label column; binary: NEGATIVE,POSITIVE",
    )
    init.add_argument(
        "--member",
        action="append",
        default=[],
        metavar="SITE=FINGERPRINT",
        help="a hospital of the study and its public-key SHA-256, as `medfed pki request` "
        "printed it and its officer read it out (repeatable)",
    )
    init.add_argument(
        "--member-from",
        action="append",
        default=[],
        type=Path,
        metavar="CSR_OR_CRT",
        help="a hospital's certificate request or signed certificate: its site id and "
        "public-key SHA-256 become a member (repeatable)",
    )
    init.set_defaults(func=_init)

    check = actions.add_parser("check", help="validate a study file and print its sha256")
    check.add_argument("--study", required=True, type=Path)
    check.add_argument("--json", action="store_true", help="one JSON object")
    check.set_defaults(func=_check)


# --------------------------------------------------------------------------- header


def read_header(path: Path) -> list[str]:
    """Column names of a CSV (its first record only) or a Parquet file (its schema)."""
    if not path.is_file():
        raise ConfigError("header-from", f"file {path} does not exist")
    if path.suffix.lower() in (".parquet", ".pq"):
        # pyarrow: loaded only to read a Parquet header, not by every `medfed study`
        import pyarrow.parquet as pq  # type: ignore[import-untyped]

        names = list(pq.read_schema(path).names)
    else:
        names = _csv_header(path)
    stripped = [name.strip() for name in names]
    if any(not name for name in stripped):
        raise ConfigError("header-from", f"{path}: the header has an empty column name")
    repeated = sorted({n for n in stripped if stripped.count(n) > 1})
    if repeated:
        raise ConfigError("header-from", f"{path}: repeated column names {repeated}")
    return stripped


MAX_HEADER_BYTES = 1 << 20


def _csv_header(path: Path) -> list[str]:
    """The first CSV record, reading physical lines only until it is complete (a quoted
    name may span lines): the bytes after the header are never read or decoded."""
    buffer = b""
    with path.open("rb") as handle:
        while True:
            line = handle.readline(MAX_HEADER_BYTES)
            buffer += line
            if not buffer:
                raise ConfigError("header-from", f"{path} is empty (no header line)")
            if len(buffer) >= MAX_HEADER_BYTES:
                raise ConfigError("header-from", f"{path}: header line too long")
            try:
                # utf-8-sig: spreadsheet exports often start with a byte-order mark.
                text = buffer.decode("utf-8-sig")
            except UnicodeDecodeError as exc:
                raise ConfigError("header-from", f"{path}: header is not UTF-8: {exc}") from None
            try:
                return next(csv.reader(io.StringIO(text), strict=True))
            except csv.Error:
                if not line:  # end of file inside a quoted name
                    raise ConfigError("header-from", f"{path}: unreadable header") from None
            except StopIteration:
                raise ConfigError("header-from", f"{path} is empty (no header line)") from None


def _split_list(text: str, what: str) -> list[str]:
    items = [item.strip() for item in text.split(",")]
    if not items or any(not item for item in items):
        raise ConfigError(what, f"expected a comma-separated list, got {text!r}")
    return items


def _parse_classes(text: str) -> list[int | str]:
    items = _split_list(text, "classes")
    if all(re.fullmatch(r"-?\d+", item) for item in items):
        return [int(item) for item in items]
    return list(items)


TABLE_DEFAULT_MODEL = "logistic"
"""Tables start from logistic regression: under DP-SGD the fewest coordinates to noise,
and the model class of the centralized baseline a study is judged against
(`medfed bench utility`, docs/benchmarks.md)."""

TABLE_DEFAULT_LEARNING_RATE = 1.0
"""Per-unit gradients are clipped to max_grad_norm (C = 1), so a DP-SGD step moves the
weights by at most lr * C: at 0.1 a study of ten rounds ends before the model converges.
With clipping binding for most units, DP-SGD behaves like normalized SGD and tolerates
a larger step (De et al. 2022, "Unlocking High-Accuracy Differentially Private Image
Classification through Scale"; Ponomareva et al. 2023, "How to DP-fy ML", section 5.4),
measured on four real cohorts in docs/benchmarks.md."""


def draft_study(
    *,
    name: str,
    rounds: int,
    label_column: str,
    patient_column: str | None,
    columns: Sequence[str],
    categorical: dict[str, list[str]],
    missing: str,
    classes: list[int | str],
    members: Sequence[tuple[str, str]] = (),
) -> Study:
    """The study `study init` writes: every column but label and patient id is a feature;
    `members` (site id, public-key fingerprint) are its hospitals."""
    reserved = {label_column, patient_column}
    features = [c for c in columns if c not in reserved]
    for column in categorical:
        if column not in features:
            raise ConfigError("categorical", f"{column!r} is not one of the feature columns")
    data: dict[str, Any] = {"label_column": label_column}
    if patient_column is not None:
        data["patient_column"] = patient_column
    mapping: dict[str, Any] = {
        "study": {
            "name": name,
            "rounds": rounds,
            "task": "binary" if len(classes) == 2 else "multiclass",
            "classes": classes,
        },
        "data": data,
        "features": [
            {"name": c, "type": "categorical", "levels": categorical[c], "missing": missing}
            if c in categorical
            else {"name": c, "type": "numeric", "missing": missing}
            for c in features
        ],
        "model": {"name": TABLE_DEFAULT_MODEL},
        "training": {"learning_rate": TABLE_DEFAULT_LEARNING_RATE},
        "privacy": {"unit": "patient" if patient_column else "record"},
    }
    if members:
        mapping["members"] = [{"name": n, "fingerprint": f} for n, f in members]
    return study_from_mapping(mapping, source="the study init flags")


# --------------------------------------------------------------------------- TOML


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # JSON strings are TOML basic strings
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise ConfigError("study", f"cannot write {value!r} as TOML")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.match(key) else json.dumps(key, ensure_ascii=False)


_COMMENTS = {
    "study": [
        "What the federation predicts. classes: labels as written in the label column;",
        'for task = "binary" the second one is the positive class.',
    ],
    "data": [
        "Column names every site's file must have (each site keeps its own file path).",
    ],
    "features": [
        "One block per input column, in the model's input order.",
        'type: "numeric", or "categorical" with levels = [...] as written in the file',
        "  (one-hot encoded in this order; a level not declared here is an error).",
        'missing: "error" refuses the file, "impute" fills in the federated DP global',
        '  value, "indicator" imputes and adds a was-missing column.',
        'range: "auto" (estimated in the federated DP statistics) or [low, high]; values',
        "  are clipped into it before standardising with the global statistics.",
    ],
    "model": [
        'name: "logistic" (logistic regression) or "mlp" (hidden = layer sizes) for',
        "tables; " + ", ".join(f'"{name}"' for name in model_names("images"))
        + " for images; or",
        'custom = "package.module:factory" instead of name.',
        "max_abs_weight: the largest |weight| a global model may hold; every site refuses",
        "a larger one before training on it (an honest run stays far inside the default).",
    ],
    "training": [
        f"Local DP-SGD and the server optimizer ({', '.join(SERVER_OPTIMIZERS)}). Each unit's",
        "gradient is clipped to privacy.max_grad_norm, so a step moves at most",
        "learning_rate x max_grad_norm: 1.0 converges within the rounds on tables.",
    ],
    "privacy": [
        "Requests: a site joins only if they are at least as strict as its own policy,",
        'which always wins. unit: "record", "patient" or "hospital".',
        'unit = "hospital": each site\'s budget is charged per patient (model updates at',
        "2S), which bounds the hospital-level epsilon too with intermediaries = 1;",
        'v > 1 or "auto" (up to 8 per round) make the hospital-level epsilon v-fold of',
        "the intermediary-level one (docs/privacy.md, section 7).",
        "[privacy.evaluation] max_evaluations: DP evaluations asked of every site, one per",
        'training round plus the final evaluation round; "derived" = rounds + 1. A site',
        "whose policy.max_evaluations is smaller refuses the study when it receives it.",
        "noise_std: the noise std on each summed count of a DP score histogram; every",
        "member adds its share of it (a site whose privacy.evaluation_noise_std, the least",
        "it accepts, is larger refuses the study).",
    ],
    "members": [
        "The hospitals of this study: site id and the SHA-256 of its public key, as",
        "`medfed pki request` printed it and its officer read it out. Every site refuses",
        "a round naming anyone else, or a member under another key (a CA holder's sybils),",
        "before any share leaves it. A new hospital means a new study that every site",
        "approves again (`medfed site approve`).",
    ],
}


def _table(lines: list[str], header: str, values: dict[str, Any]) -> None:
    lines.append(header)
    nested = []
    for key, value in values.items():
        if value is None:
            continue  # TOML has no null: an absent key takes its default
        if isinstance(value, dict) and key != "options":
            nested.append((key, value))
            continue
        if key == "options" and not value:
            continue
        lines.append(f"{_toml_key(key)} = {_toml_value(value)}")
    for key, value in nested:
        lines.append("")
        _table(lines, f"[{header.strip('[]')}.{_toml_key(key)}]", value)


def _model_fields_that_apply(model: dict[str, Any]) -> dict[str, Any]:
    """``hidden`` and ``dropout`` shape the mlp only: left out for another model while
    they hold their defaults (the file still loads back to the same study)."""
    defaults = ModelSection.model_fields
    if model.get("name") == "mlp":
        return model
    return {
        key: value for key, value in model.items()
        if key not in ("hidden", "dropout")
        or value != _json_default(defaults[key].default)
    }


def _json_default(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def render_study_toml(study: Study) -> str:
    """A commented TOML file that loads back to exactly `study`."""
    dumped = study.model_dump(mode="json")
    lines = [
        "# medfed study: what this federation trains. Drafted by `medfed study init` from",
        "# column names only; edit it, then run `medfed data check --study THIS --data FILE`",
        "# at every site. Operational settings (addresses, state, deadlines) do not go here.",
    ]
    for section in ("study", "data", "features", "model", "training", "privacy", "members"):
        if section == "members" and not study.members:
            continue
        lines.append("")
        lines.extend(f"# {text}" for text in _COMMENTS[section])
        if section in ("features", "members"):
            for index, item in enumerate(dumped[section]):
                if index:
                    lines.append("")
                _table(lines, f"[[{section}]]", item)
        elif section == "model":
            _table(lines, "[model]", _model_fields_that_apply(dumped["model"]))
        else:
            _table(lines, f"[{section}]", dumped[section])
    text = "\n".join(lines) + "\n"
    loaded = study_from_mapping(_loads(text), source="the rendered study")
    if loaded != study:
        raise ConfigError("study", "internal: the rendered TOML does not load back")
    return text


def _loads(text: str) -> dict[str, Any]:
    return parse_toml(text)


# --------------------------------------------------------------------------- commands


def _init(args: argparse.Namespace) -> int:
    out: Path = args.out
    if out.exists():
        raise ConfigError("out", f"{out} already exists; not overwriting it")
    if args.header_from is not None:
        columns = read_header(args.header_from)
        for column in (args.label_column, args.patient_column):
            if column is not None and column not in columns:
                raise ConfigError(
                    "label-column" if column == args.label_column else "patient-column",
                    f"{column!r} is not a column of {args.header_from}",
                )
    else:
        columns = _split_list(args.features, "features")
    categorical: dict[str, list[str]] = {}
    for item in args.categorical:
        column, sep, levels = item.partition("=")
        if not sep or not column.strip():
            raise ConfigError("categorical", f"expected COL=L1,L2,..., got {item!r}")
        categorical[column.strip()] = _split_list(levels, "categorical")
    study = draft_study(
        name=args.name,
        rounds=args.rounds,
        label_column=args.label_column,
        patient_column=args.patient_column,
        columns=columns,
        categorical=categorical,
        missing=args.missing,
        classes=_parse_classes(args.classes),
        members=_members(args.member, args.member_from),
    )
    text = render_study_toml(study)
    try:
        with out.open("x", encoding="utf-8") as handle:  # "x": never overwrite
            handle.write(text)
    except FileExistsError:
        raise ConfigError("out", f"{out} already exists; not overwriting it") from None
    except OSError as exc:
        raise ConfigError("out", f"cannot write {out}: {exc.strerror}") from None
    print(
        f"wrote {out}: {len(study.features)} features, label {study.data.label_column!r}, "
        f"sha256 {study_sha256(study)}"
    )
    _print_members(study)
    warning = intermediaries_warning(study.privacy)
    if warning is not None:
        print(warning, file=sys.stderr)
    return 0


def _members(pairs: Sequence[str], files: Sequence[Path]) -> list[tuple[str, str]]:
    """--member SITE=FINGERPRINT and --member-from CSR_OR_CRT, in the order given."""
    out = []
    for item in pairs:
        name, sep, fingerprint = item.partition("=")
        if not sep or not name.strip():
            raise ConfigError("member", f"expected SITE=FINGERPRINT, got {item!r}")
        out.append((name.strip(), fingerprint.strip()))
    for path in files:
        try:
            text = path.read_bytes()
        except OSError as exc:
            raise ConfigError("member-from", f"cannot read {path}: {exc.strerror}") from None
        try:
            if b"CERTIFICATE REQUEST" in text:
                csr, identity = pki.load_request(path)
                if identity.role is not pki.Role.SITE:
                    raise ConfigError("member-from", f"{path} requests a "
                                      f"{identity.role.value} certificate, not a site's")
                out.append((identity.name, pki.public_key_fingerprint(csr)))
            else:
                cert = pki.load_certificate(path)
                out.append((pki.site_id_from_certificate(cert),
                            pki.public_key_fingerprint(cert)))
        except PkiError as exc:
            raise ConfigError("member-from", f"{path}: {exc}") from None
    return out


def _print_members(study: Study) -> None:
    if not study.members:
        print("  members: none listed: any site certificate the CA signs may be in a round "
              "(a CA holder could run sybil sites); list them with --member-from or "
              "[[members]]", file=sys.stderr)
        return
    print(f"  members ({len(study.members)}), public-key SHA-256:")
    for member in study.members:
        print(f"    {member.name:<24} {member.fingerprint}")


def _check(args: argparse.Namespace) -> int:
    study = load_study(args.study)
    summary: dict[str, Any] = {
        "study": study.study.name,
        "sha256": study_sha256(study),
        "task": study.study.task,
        "classes": list(study.study.classes),
        "features": [f.name for f in study.features],
        "encoded_features": encoded_feature_names(study),
        "model": study.model.custom or study.model.name,
        "rounds": study.study.rounds,
        "final_evaluation": study.training.final_evaluation,
        "evaluations": study.max_evaluations,
        "privacy": study.privacy.model_dump(mode="json"),
        "members": study.member_fingerprints(),
    }
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    else:
        print(f"study {summary['study']}: ok, sha256 {summary['sha256']}")
        print(f"  {len(study.features)} features -> {len(summary['encoded_features'])} inputs")
        print(f"  task {study.study.task}, classes {list(study.study.classes)}")
        print(f"  model {summary['model']}, {study.study.rounds} rounds")
        p = study.privacy
        print(f"  privacy request: unit {p.unit}, epsilon {p.epsilon:g}, delta {p.delta:g}")
        print(f"  DP evaluations asked of every site: {study.max_evaluations} "
              f"({study.evaluations_planned_text()})")
        _print_members(study)
    warning = intermediaries_warning(study.privacy)
    if warning is not None:
        print(warning, file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m common.commands.study study ...``: this plug-in alone."""
    return main_with([register], argv)


if __name__ == "__main__":
    sys.exit(main())
