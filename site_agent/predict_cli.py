"""``medfed data check``, ``medfed model init|show|export`` and ``medfed predict``: a
hospital's tools, and the operator's `model init` (it needs torch, which the coordinator
image does not carry; the site image does).

All run locally, with no coordinator and no network. Registered through the
``medfed.commands`` entry points ``data``, ``model`` and ``predict``.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import sys
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from common.core.errors import DataError
from common.core.text import csv_cell, printable
from common.releases.bundle import (
    bundle_summary,
    evaluation_auc_text,
    evaluation_noise_text,
    read_bundle,
)
from common.study import load_study
from site_agent.data import load_study_table
from site_agent.datacheck import check_data_against_study, format_report


def register_data(subparsers: Any) -> None:
    """Add ``medfed data check``."""
    parser = subparsers.add_parser("data", help="check a site's data file against a study")
    actions = parser.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    check = actions.add_parser(
        "check",
        help="records, patients, missing values, levels, label balance, delta vs cohort size",
        description="Runs at the hospital with no coordinator; sends nothing. Exit 0: the "
        "file fits the study; 1: a cohort-level problem (too few units, delta too large); "
        "2: a mismatch naming file, row and column.",
    )
    check.add_argument("--study", required=True, type=Path)
    check.add_argument("--data", required=True, type=Path,
                       help="CSV or Parquet file; for an images study, the image folder "
                       "with labels.csv")
    check.add_argument("--delta", type=float, help="check this delta (default: the study's)")
    check.add_argument("--json", action="store_true", help="one JSON object on the last line")
    check.set_defaults(func=_data_check)


def register_model(subparsers: Any) -> None:
    """Add ``medfed model init``, ``show`` and ``export``."""
    parser = subparsers.add_parser(
        "model", help="a study's initial model; inspect or export a model bundle")
    actions = parser.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    init = actions.add_parser(
        "init",
        help="write a study's untrained network for `coordinator serve --initial-model`",
        description="Builds the study's untrained network from the public seed, exactly as "
        "a coordinator with torch does, and writes it as safetensors bound to the study's "
        "SHA-256. For a coordinator without torch (the coordinator image): run this where "
        "torch is (the site image, a workstation) on the study file the coordinator serves, "
        "members included, then start it with --initial-model FILE.",
    )
    init.add_argument("--study", required=True, type=Path,
                      help="the study the coordinator serves (the same bytes)")
    init.add_argument("--out", required=True, type=Path, help="the file to write")
    init.set_defaults(func=_model_init)
    show = actions.add_parser("show", help="print the model card (study, threshold, privacy)")
    show.add_argument("--model", required=True, type=Path)
    show.add_argument("--json", action="store_true", help="one JSON object")
    show.set_defaults(func=_model_show)
    export = actions.add_parser(
        "export",
        help="export the bundle for other runtimes (ONNX, preprocessing included)",
        description="Writes one ONNX file that gives the same probabilities as `medfed "
        "predict`: the bundle's preprocessing (impute, clip, standardise) is part of the "
        "graph; the input column order, classes, threshold and privacy card are in its "
        "metadata. Needs the onnx package (pip install onnx).",
    )
    export.add_argument("--model", required=True, type=Path, help="model bundle .safetensors")
    export.add_argument("--format", default="onnx", help="export format (only: onnx)")
    export.add_argument("--out", required=True, type=Path, help="the file to write")
    export.add_argument(
        "--allow-factory",
        action="append",
        default=[],
        metavar="PKG.MOD:FN",
        help="run this custom model factory from an installed package (repeatable)",
    )
    export.set_defaults(func=_model_export)


def register_predict(subparsers: Any) -> None:
    """Add ``medfed predict``."""
    parser = subparsers.add_parser(
        "predict",
        help="score a data file with a model bundle",
        description="Applies the bundle's preprocessing and model. With the study's label "
        "column in the file, prints AUC, sensitivity, specificity and PPV at the bundled "
        "threshold.",
    )
    parser.add_argument("--model", required=True, type=Path, help="model bundle .safetensors")
    parser.add_argument("--data", required=True, type=Path,
                        help="CSV or Parquet file; for an images study, a folder of images "
                        "with labels.csv (the label column optional)")
    parser.add_argument("--out", type=Path, help="scores CSV (default: standard output)")
    parser.add_argument("--json", action="store_true", help="metrics as JSON on the last line")
    parser.add_argument(
        "--allow-factory",
        action="append",
        default=[],
        metavar="PKG.MOD:FN",
        help="run this custom model factory from an installed package (repeatable)",
    )
    parser.set_defaults(func=_predict)


# --------------------------------------------------------------------------- commands


def _data_check(args: argparse.Namespace) -> int:
    study = load_study(args.study)
    try:
        report = check_data_against_study(args.data, study, delta=args.delta)
    except DataError as exc:
        if not args.json:
            raise
        print("medfed: error: " + printable(str(exc)), file=sys.stderr)
        error = {"file": exc.file, "row": exc.row, "column": exc.column, "message": exc.message}
        print(json.dumps({"ok": False, "error": error}, sort_keys=True))
        return 2
    if args.json:
        print(json.dumps(report.to_json(), sort_keys=True))
    else:
        # Column names and levels come from the data file: escapes are shown, not run.
        print(printable("\n".join(format_report(report)), keep="\n"))
    return 0 if report.ok else 1


def _model_init(args: argparse.Namespace) -> int:
    from common.models.build import initial_model
    from common.models.initial_file import INITIAL_MODEL_SEED, write_initial_model
    from common.models.layout import wire_model

    study = load_study(args.study)
    layout, flat = wire_model(initial_model(study, seed=INITIAL_MODEL_SEED))
    digest = write_initial_model(args.out, study, layout, flat, seed=INITIAL_MODEL_SEED)
    print(f"initial model of study {study.study.name!r}: {flat.size:,} parameters in "
          f"{len(layout)} tensors -> {args.out} (content sha256 {digest}, the same on "
          "every run for this study and torch version)")
    return 0


def _model_show(args: argparse.Namespace) -> int:
    bundle = read_bundle(args.model)

    def say(line: str) -> None:
        # Names come from the file: a control character is shown escaped, never run
        # by the terminal.
        print(printable(line))

    summary = bundle_summary(bundle)
    summary["file_sha256"] = hashlib.sha256(args.model.read_bytes()).hexdigest()
    if args.json:
        print(json.dumps(summary, sort_keys=True))  # ensure_ascii: escapes them all
        return 0
    card = bundle.card
    arch = bundle.architecture
    say(f"model bundle {args.model} (sha256 {summary['file_sha256']})")
    say(f"  study {summary['study']} (sha256 {summary['study_sha256'][:16]}...)")
    state = "final" if bundle.final else "intermediate"
    say(f"  round {bundle.round} ({state}); task {summary['task']}, classes {summary['classes']}")
    say(f"  label column {summary['label_column']!r}")
    say(f"  model {arch.custom or arch.name}: {summary['parameters']} parameters")
    if bundle.study.data.kind == "images":
        say(f"  inputs: {summary['inputs']}")
    else:
        say(f"  inputs ({len(summary['encoded_features'])}): "
            f"{', '.join(summary['encoded_features'])}")
    threshold = bundle.threshold
    if threshold.value is not None:
        say(f"  threshold {threshold.value:g} ({threshold.method})")
    for line in _evaluation_noise_lines(threshold):
        say(line)
    say(f"  preprocessing statistics: {bundle.statistics.source}")
    for warning in bundle.statistics.warnings:
        say(f"  WARNING: preprocessing statistics: {warning}")
    say("privacy card")
    say(f"  unit {card.unit}; accountant {card.accountant}; rounds {card.rounds}")
    say(f"  mechanisms: {', '.join(card.mechanisms)}")
    # Under hospital-level DP sites[].epsilon is what each budget is charged with: with
    # DP-SGD beneath the larger of the record/patient-level epsilon (the better of its two
    # paths) and the add/remove-one-hospital composition; without it the per-patient
    # epsilon (card budget_charge "record_level"), or on a card written before that term
    # the add/remove-one-unit composition, which is NOT per-patient. The three named
    # figures (hospital, intermediary, patient) follow as group guarantees.
    if card.unit != "hospital":
        level = ""
    elif card.record_level is not None:
        level = f"budget charge = max({card.record_level}-level, hospital-level) "
    elif card.budget_charge == "record_level":
        level = "budget charge = per-patient (model updates at 2S) "
    else:
        level = "budget charge (add/remove one unit; not per-patient) "
    for site in card.sites:
        say(f"  site {site.site}: {level}epsilon {site.epsilon:.3g}, delta {site.delta:g}")
    for group in card.group_guarantees:
        note = f" ({group.note})" if group.note else ""
        say(f"  {group.unit}-level: epsilon {group.epsilon:.3g}, delta {group.delta:g}{note}")
    if card.secagg is None:
        say("  aggregation: plain (no secure aggregation)")
    else:
        s = card.secagg
        say(
            f"  {s.protocol}: threshold {s.threshold}, neighbours {s.neighbours}, "
            f"max colluding sites {s.max_colluding_sites}, ring 2^{s.ring_bits}"
        )
    if card.statistics_release:
        say(f"  statistics release: {card.statistics_release}")
    for query in card.queries:
        charged = (f"epsilon {query.epsilon:.3g}" if query.epsilon_composed is None else
                   f"epsilon {query.epsilon_composed:.4g} charged (its statistics composed; "
                   f"{query.epsilon:.3g} summed)")
        say(f"  query before this model: {query.name} (sha256 {query.sha256[:12]}..., "
            f"round {query.round}, {charged} on each of {query.contributors} sites, "
            "inside their epsilon above)")
    for note in card.notes:
        say(f"  note: {note}")
    return 0


def _evaluation_noise_lines(threshold: Any) -> list[str]:
    """The federated DP AUC with its noise, and a warning when the noise dominates."""
    lines = []
    if threshold.auc is not None or threshold.noise_std is not None:
        auc = evaluation_auc_text(threshold)
        noise = evaluation_noise_text(threshold)
        noise = f"; {noise}" if noise else ""
        lines.append(f"  federated DP AUC {auc}{noise}")
    if threshold.noise_dominated:
        lines.append(
            "  WARNING: the federated evaluation was noise-dominated: its AUC and the "
            "threshold chosen from it are unreliable; measure them on local labelled data "
            "with `medfed predict` (and choose a threshold there)"
        )
    return lines


def _threshold_warnings(prediction: Any, threshold: float) -> list[str]:
    """What makes the printed sensitivity/specificity meaningless by construction."""
    scores = np.asarray(prediction.scores, dtype=np.float64).reshape(-1)
    if scores.size == 0:
        return []
    if not np.any(scores >= threshold):
        return [
            f"no record reaches the bundle's threshold {threshold:g} (highest score "
            f"{scores.max():.3g}): every record is predicted negative, so sensitivity is 0 "
            "by construction; the threshold may come from a noise-dominated DP evaluation "
            "(see `medfed model show`)"
        ]
    if np.all(scores >= threshold):
        return [
            f"every record reaches the bundle's threshold {threshold:g} (lowest score "
            f"{scores.min():.3g}): every record is predicted positive, so specificity is "
            "0 by construction"
        ]
    return []


def _model_export(args: argparse.Namespace) -> int:
    from site_agent.onnx_export import export_model

    digest = export_model(
        args.model, args.out, format=args.format, allowed_factories=args.allow_factory
    )
    print(f"exported {args.model} to {args.out} ({args.format}, sha256 {digest})")
    return 0


def _write_scores(handle: TextIO, bundle: Any, table: Any, prediction: Any) -> None:
    study = bundle.study
    classes = list(study.study.classes)
    writer = csv.writer(handle)
    images = study.data.kind == "images"
    header = [study.data.file_column if images else "row"]
    if table.patient_ids is not None:
        header.append(study.data.patient_column)
    binary = study.study.task == "binary"
    header.extend(["score"] if binary else [f"score_{c}" for c in classes])
    header.append("prediction")
    # Names, labels and patient ids come from the study and the data file: no cell may
    # start a spreadsheet formula (`common.core.text.csv_cell`).
    writer.writerow([csv_cell(str(cell)) for cell in header])
    for i in range(len(table)):
        row: list[Any] = [csv_cell(_image_name(table, i)) if images else int(table.rows[i])]
        if table.patient_ids is not None:
            row.append(csv_cell(table.patient_ids[i]))
        if binary:
            row.append(f"{prediction.scores[i]:.6f}")
        else:
            row.extend(f"{p:.6f}" for p in prediction.scores[i])
        row.append(csv_cell(classes[int(prediction.predicted[i])]))
        writer.writerow(row)


def _image_name(images: Any, i: int) -> str:
    return str(Path(images.entries[i].path).relative_to(images.source).as_posix())


def _predict(args: argparse.Namespace) -> int:
    # torch and Opacus load here, not at registration: `data check` and `model show`
    # never import them.
    from site_agent.predict import predict_images, predict_table

    bundle = read_bundle(args.model)
    table: Any
    if bundle.study.data.kind == "images":
        from site_agent.imaging import image_spec_for_study, load_image_folder

        table = load_image_folder(
            args.data, image_spec_for_study(bundle.study), labels_optional=True
        )
        prediction = predict_images(bundle, table, allowed_factories=args.allow_factory)
    else:
        table = load_study_table(args.data, bundle.study, for_prediction=True)
        prediction = predict_table(bundle, table, allowed_factories=args.allow_factory)
    human = sys.stdout
    if args.out is not None:
        with args.out.open("w", newline="", encoding="utf-8") as handle:
            _write_scores(handle, bundle, table, prediction)
    elif not args.json:
        _write_scores(sys.stdout, bundle, table, prediction)
        human = sys.stderr  # keep standard output a clean CSV
    summary: dict[str, Any] = {"records": len(table), "out": str(args.out) if args.out else None}
    if bundle.study.study.task == "binary":
        value = bundle.threshold.value
        warnings = _threshold_warnings(prediction, 0.5 if value is None else value)
        for warning in warnings:
            print(f"medfed: warning: {warning}", file=sys.stderr)
        summary["warnings"] = warnings
    metrics = prediction.metrics
    if metrics is not None:
        summary.update(metrics)
        if "sensitivity" in metrics:
            print(
                f"AUC {_fmt(metrics['auc'])}; at threshold {metrics['threshold']:g}: "
                f"sensitivity {_fmt(metrics['sensitivity'])}, specificity "
                f"{_fmt(metrics['specificity'])}, PPV {_fmt(metrics['ppv'])} "
                f"(n = {metrics['n']})",
                file=human,
            )
        else:
            print(
                f"AUC (mean one-vs-rest) {_fmt(metrics['auc'])}; accuracy "
                f"{metrics['accuracy']:.3f} (n = {metrics['n']})",
                file=human,
            )
    else:
        print(
            f"scored {len(table)} records (no {bundle.study.data.label_column!r} column: "
            "no metrics)",
            file=human,
        )
    if args.out is not None:
        print(f"scores written to {args.out}", file=human)
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    return 0


def _fmt(value: float | None) -> str:
    return "undefined" if value is None else f"{value:.3f}"


def main(argv: list[str] | None = None) -> int:
    """``python -m site_agent.predict_cli ...``: these plug-ins alone."""
    from common.commands.cli import main_with

    return main_with([register_data, register_model, register_predict], argv)


if __name__ == "__main__":
    sys.exit(main())
