"""Pure decisions taken before a round opens: who may be selected, the round's number,
its SecAgg+ parameters and the announcement itself. No I/O, no clock of its own."""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping, Sequence

from common.core.codec import TensorSpec
from common.core.config import AggregationSection, CoordinatorSettings
from common.core.errors import ConfigError
from common.crypto.quantize import bits_for_sites, max_integer_for_sites
from common.privacy.budget import BudgetReport
from common.privacy.federation import has_budget_left
from common.protocol.secagg.params import ThreatModel, choose_parameters
from common.releases.egress import round_manifest
from common.releases.seam import KIND_RELEASE, DpRelease, release_kind
from common.rounds.announcement import Announcement
from coordinator import hospital_sum
from coordinator.study_run import StudyRun


def with_budget(
    site_ids: Sequence[str],
    *,
    reports: Mapping[str, BudgetReport],
    view: Mapping[str, BudgetReport],
    evaluation_round: bool,
) -> list[str]:
    """The sites (order kept) that selection may pick, judged by the federation view:
    not exhausted and more than `MIN_REMAINING_EPSILON` left. A site with no row in the
    view keeps no ledger (runs without DP accounting). The final evaluation round trains
    nothing and spends no budget: every site may join it."""
    if evaluation_round:
        return list(site_ids)
    chosen = []
    for site_id in site_ids:
        report = reports.get(site_id)
        if report is not None and report.out_of_budget:
            continue
        row = view.get(site_id)
        if row is None or has_budget_left(row):
            chosen.append(site_id)
    return chosen


def next_round_number(
    *, recorded_next: int, ledger_last_rounds: Iterable[int | None], ceiling: int | None = None,
) -> int:
    """After every round this coordinator ever recorded AND after every round the
    participants' own ledgers already hold. A coordinator restored from an old backup
    (or started on empty state) would otherwise reuse round numbers that sites have
    spent budget on, and they refuse such rounds.

    `ceiling` (`round_ceiling`): a ledger report above it is not followed (a site
    claiming a round far ahead of the coordinator's record that no other site
    corroborates, or a round this coordinator itself ran beyond its record)."""
    followed = [(n or 0) + 1 for n in ledger_last_rounds if ceiling is None or (n or 0) <= ceiling]
    return max([recorded_next, *followed])


def round_ceiling(
    *, recorded_next: int, reports: Mapping[str, int | None], ran: Container[int],
    window: int, quorum: int,
) -> tuple[int, dict[str, int]]:
    """How far the round numbering may follow the sites' ledger reports, and the sites
    whose report is refused (site -> reported ledger_last_round).

    One site's report is followed up to `window` rounds past the coordinator's own
    record (`recorded_next`): a coordinator restored from a recent backup, a site that
    restored its ledger a few rounds ahead. Further only when `quorum` sites (one more
    than the colluding sites the federation is configured against) report at least as
    far: a coordinator restored from an old backup finds every site that trained since
    ahead by the same rounds, while a lying site alone (ledger_last_round = 2^53 - 2)
    cannot renumber the federation, or push the next number past what the wire allows.
    A report of a round this coordinator ran itself (`ran`, e.g. beyond a jump an old
    lie caused) is explained by that round and moves nothing. Every other report beyond
    the ceiling is an outlier."""
    limit = recorded_next - 1 + window
    beyond = {site: n for site, n in reports.items()
              if n is not None and n > limit and n not in ran}
    ceiling = limit
    if quorum >= 1 and len(beyond) >= quorum:
        ceiling = max(ceiling, sorted(beyond.values(), reverse=True)[quorum - 1])
    return ceiling, {site: n for site, n in beyond.items() if n > ceiling}


def round_parameters(n_sites: int, agg: AggregationSection) -> tuple[int, int]:
    """(threshold, neighbours) for `n_sites`; (0, 0) for plain rounds."""
    if not agg.secure_aggregation:
        return 0, 0
    colluding = agg.max_colluding_sites
    dropouts = agg.max_dropouts
    if dropouts == "auto":
        # As many dropouts as the collusion bound leaves room for.
        dropouts = 0
        while True:
            try:
                choose_parameters(n_sites, ThreatModel(colluding, dropouts + 1), agg.neighbours)
            except ConfigError:
                break
            dropouts += 1
    threshold, neighbours = choose_parameters(
        n_sites, ThreatModel(colluding, dropouts), agg.neighbours
    )
    if agg.threshold != "auto":
        threshold = agg.threshold
    return threshold, neighbours


def announcement(
    settings: CoordinatorSettings,
    participants: Sequence[str],
    *,
    number: int,
    nonce: bytes,
    layout: tuple[TensorSpec, ...],
    model_sha256: bytes,
    model_bytes: int,
    evaluation_round: bool,
    now: float,
    study_sha256: bytes = b"",
    statistics: bytes = b"",
    histogram_edges: tuple[float, ...] = (),
) -> Announcement:
    """The announcement of model round `number` for `participants`."""
    cfg = settings
    model_dim = sum(spec.elements for spec in layout)
    threshold, neighbours = round_parameters(len(participants), cfg.aggregation)
    bins = announced_bins(cfg, histogram_edges)
    return Announcement(
        round_number=number,
        round_nonce=nonce,
        participants=tuple(participants),
        threshold=threshold,
        neighbours=neighbours,
        vector_length=round_manifest(
            model_elements=model_dim, histogram_bins=bins
        ).vector_length,
        quantization_bits=bits_for_sites(len(participants)),
        clip=cfg.aggregation.clip,
        histogram_bins=bins,
        secure_aggregation=cfg.aggregation.secure_aggregation,
        model_layout=layout,
        model_sha256=model_sha256,
        model_bytes=model_bytes,
        # After the planned training rounds, one evaluation-only round (no training,
        # no privacy spend) measures the final model through the same secure sum.
        local_epochs=0 if evaluation_round else cfg.training.local_epochs,
        learning_rate=cfg.training.learning_rate,
        fedprox_mu=cfg.training.fedprox_mu,
        planned_rounds=cfg.rounds,
        train_deadline_ms=int((now + cfg.deadlines.train_seconds) * 1000),
        phase_timeout_ms=int(cfg.deadlines.phase_seconds * 1000),
        weight_cap=min(cfg.aggregation.weight_cap, max_integer_for_sites(len(participants))),
        max_chunk_bytes=cfg.limits.max_chunk_bytes,
        heartbeat_ms=round(cfg.deadlines.heartbeat_seconds * 1000),
        study_sha256=study_sha256,
        statistics=statistics,
        histogram_edges=histogram_edges,
    )


def release_announcement(
    settings: CoordinatorSettings,
    participants: Sequence[str],
    *,
    study: StudyRun,
    number: int,
    nonce: bytes,
    now: float,
    release: DpRelease,
    payload: bytes = b"",
) -> Announcement:
    """The announcement of round `number`, which carries `release` alone
    (`common.releases.seam`: the study's statistics, an approved query): the study's
    hash, no model and no training, the release's vector length, and the exact bytes it
    was built from (`payload`, bound into the digest: an approved query's), if any."""
    cfg = settings
    threshold, neighbours = round_parameters(len(participants), cfg.aggregation)
    kind = release_kind(release.name)
    return Announcement(
        round_number=number, round_nonce=nonce, participants=tuple(participants),
        threshold=threshold, neighbours=neighbours, vector_length=release.length,
        quantization_bits=bits_for_sites(len(participants)), clip=cfg.aggregation.clip,
        histogram_bins=cfg.aggregation.histogram_bins,
        secure_aggregation=cfg.aggregation.secure_aggregation, model_layout=(),
        model_sha256=b"", model_bytes=0, local_epochs=0,
        learning_rate=cfg.training.learning_rate, fedprox_mu=cfg.training.fedprox_mu,
        planned_rounds=cfg.rounds,
        train_deadline_ms=int((now + cfg.deadlines.train_seconds) * 1000),
        phase_timeout_ms=int(cfg.deadlines.phase_seconds * 1000), weight_cap=1,
        max_chunk_bytes=cfg.limits.max_chunk_bytes, study_sha256=bytes.fromhex(study.sha256),
        kind=kind.round_kind,
        release_name=kind.name if kind.round_kind == KIND_RELEASE else "",
        release_payload=payload,
        heartbeat_ms=round(cfg.deadlines.heartbeat_seconds * 1000),
    )


def announced_bins(settings: CoordinatorSettings, edges: tuple[float, ...]) -> int:
    """A round's ``histogram_bins``: the study's, or as many as the announced edges
    count (one more edge than buckets per block: the last round chose fewer buckets
    where its noise allowed no more, common.releases.evaluation_edges.evaluation_bins)."""
    if not edges:
        return settings.aggregation.histogram_bins
    classes = settings.aggregation.histogram_classes
    return len(edges) - (classes if classes > 2 else 1)


def study_release(study: StudyRun, name: str) -> DpRelease:
    """The registered release `name` for the study being run."""
    kind = release_kind(name)
    if kind.build is None or not kind.round_kind:
        raise ConfigError("release", f"{name!r} is not a release of its own round")
    return kind.build(study.study)


def study_announcement(
    settings: CoordinatorSettings,
    participants: Sequence[str],
    *,
    study: StudyRun | None,
    number: int,
    nonce: bytes,
    layout: tuple[TensorSpec, ...],
    model_sha256: bytes,
    model_bytes: int,
    evaluation_round: bool,
    now: float,
    intermediaries: int | None = None,
    histogram_edges: tuple[float, ...] = (),
) -> Announcement:
    """`announcement` of a model round for the study being run (its hash, its
    statistics release, its hospital-level terms, with the "auto" intermediaries chosen
    last round and the evaluation buckets set from last round's released histogram)."""
    ann = announcement(
        settings, participants, number=number, nonce=nonce, layout=layout,
        model_sha256=model_sha256, model_bytes=model_bytes,
        evaluation_round=evaluation_round, now=now,
        study_sha256=bytes.fromhex(study.sha256) if study is not None else b"",
        statistics=study.statistics_bytes if study is not None else b"",
        histogram_edges=histogram_edges,
    )
    return hospital_sum.announce(ann, hospital_sum.terms_for(
        study.study if study is not None else None, settings.aggregation,
        intermediaries=intermediaries))
