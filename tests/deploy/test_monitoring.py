"""Monitoring files against the real product.

Two Prometheus setups ship, and they are kept apart: the consortium operator's
(deploy/prometheus: the coordinator only, over HTTPS with a monitor certificate; the
dashboard deploy/grafana/dashboards) and each hospital's own (deploy/prometheus/site: its
site agent; the dashboard deploy/grafana/site). What the operator's dashboard and alerts
query are the coordinator's series and nothing else, so a hospital's exact training
counts never need to leave the hospital: checked here against the names each side's
metrics classes register.

`promtool` validates both configs, both sets of alert rules (and their unit tests) and
the LIVE /metrics output of a real coordinator (scraped over HTTPS with a monitor
certificate) and a real site agent, started as OS processes after one secure round
completed. Every medfed_* series a dashboard or an alert rule queries must exist in the
live output of its side, so a renamed metric breaks this test rather than a dashboard in
production. A real Prometheus, run with the operator's shipped scrape job, scrapes the
live coordinator over mutual TLS.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import shutil
import ssl
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from common.core.processes import ManagedProcess
from common.protocol import pki
from coordinator.metrics import CoordinatorMetrics
from site_agent.metrics import SiteMetrics
from tests.e2e.harness import REPO, Federation, free_port

OPERATOR = REPO / "deploy" / "prometheus"
HOSPITAL = OPERATOR / "site"
OPERATOR_DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "medfed-federation.json"
HOSPITAL_DASHBOARD = REPO / "deploy" / "grafana" / "site" / "medfed-site.json"
PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool not installed (Debian package `prometheus`; .ci/scripts/install-tools.sh)",
)
METRIC_NAME = re.compile(r"\bmedfed_[a-z0-9_]+")
JOB = re.compile(r'\bjob\s*=~?\s*"([^"]*)"')
SITES = ["paediatric", "geriatric", "rural"]
MONITOR = "prometheus"


def promtool(*args: str, stdin: str | None = None,
             cwd: Path = OPERATOR) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], input=stdin, capture_output=True, text=True,
                          cwd=cwd, timeout=120)


def dashboard_expressions(path: Path) -> list[str]:
    dashboard = json.loads(path.read_text())
    return [target["expr"] for panel in dashboard["panels"]
            for target in panel.get("targets", [])]


def rules(folder: Path) -> list[dict[str, Any]]:
    groups = yaml.safe_load((folder / "alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def alert_expressions(folder: Path) -> list[str]:
    return [rule["expr"] for rule in rules(folder)]


def sample_names(exposition: str) -> set[str]:
    """Names of the samples in a text exposition (with _bucket/_sum/_count/_total)."""
    names = set()
    for line in exposition.splitlines():
        if line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",),
            "histogram": ("_bucket", "_sum", "_count", "_created")}


def exported_names(registry: CollectorRegistry) -> set[str]:
    """Every sample name `registry` can export, labelled series not used yet included."""
    return {family.name + suffix for family in registry.collect()
            for suffix in SUFFIXES[family.type]}


def queried_names(exprs: list[str]) -> set[str]:
    return {name for expr in exprs for name in METRIC_NAME.findall(expr)}


# --------------------------------------------------------------------------- static


def _with_test_pki(config: str, pki_dir: Path) -> str:
    """The operator's config with its /pki/ files at `pki_dir` (promtool checks that they
    exist): ca.crt, and the "prometheus" monitor pair as pki-init lays them out."""
    cert, key = pki.monitor_paths(pki_dir, MONITOR)
    return (config.replace("/pki/ca.crt", str(pki_dir / "ca.crt"))
            .replace("/pki/prometheus.crt", str(cert)).replace("/pki/prometheus.key", str(key)))


@pytest.fixture(scope="module")
def monitor_pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("monitoring-pki") / "pki"
    now = dt.datetime.now(dt.UTC)
    pki.init_ca(directory, now=now)
    pki.issue_monitor(directory, MONITOR, now=now)
    return directory


@needs_promtool
def test_both_prometheus_configs_and_rules_pass_promtool(
    monitor_pki: Path, tmp_path: Path
) -> None:
    operator = tmp_path / "operator"
    operator.mkdir()
    shutil.copy(OPERATOR / "alerts.yml", operator / "alerts.yml")
    (operator / "prometheus.yml").write_text(
        _with_test_pki((OPERATOR / "prometheus.yml").read_text(), monitor_pki))
    for folder in (operator, HOSPITAL):
        config = promtool("check", "config", "prometheus.yml", cwd=folder)
        assert config.returncode == 0, config.stdout + config.stderr
        checked = promtool("check", "rules", "alerts.yml", cwd=folder)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert f"SUCCESS: {len(rules(folder))} rules found" in checked.stdout


@needs_promtool
@pytest.mark.parametrize("folder", [OPERATOR, HOSPITAL], ids=["operator", "hospital"])
def test_alert_rule_unit_tests_pass(folder: Path) -> None:
    result = promtool("test", "rules", "alerts_test.yml", cwd=folder)
    assert result.returncode == 0, result.stdout + result.stderr
    tested = set(re.findall(r"alertname: (\w+)", (folder / "alerts_test.yml").read_text()))
    assert {r["alert"] for r in rules(folder) if "alert" in r} <= tested


def test_the_operators_prometheus_scrapes_the_coordinator_only_over_tls() -> None:
    config = yaml.safe_load((OPERATOR / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "medfed-coordinator"
    assert job["scheme"] == "https"
    assert set(job["tls_config"]) >= {"ca_file", "cert_file", "key_file"}
    assert config["rule_files"] == ["alerts.yml"]
    hospital = yaml.safe_load((HOSPITAL / "prometheus.yml").read_text())
    assert [j["job_name"] for j in hospital["scrape_configs"]] == ["medfed-site"]


def test_every_alert_is_defined_on_its_side_with_a_runbook() -> None:
    operator = {r["alert"]: r for r in rules(OPERATOR) if "alert" in r}
    hospital = {r["alert"]: r for r in rules(HOSPITAL) if "alert" in r}
    assert {"MedfedSiteBudgetAlmostSpent", "MedfedSiteSilent", "MedfedCoordinatorDown",
            "MedfedRoundsFailing", "MedfedQuorumMarginLow", "MedfedCrlExpiresSoon",
            "MedfedCertificateExpiresSoon"} == set(operator)
    assert {"MedfedSiteLedgerBudgetAlmostSpent", "MedfedSiteBudgetExhausted",
            "MedfedSiteDown", "MedfedSiteDisconnected", "MedfedSiteCrlExpiresSoon",
            "MedfedSiteCertificateExpiresSoon"} == set(hospital)
    alerts = {**operator, **hospital}
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in {"info", "warning", "critical"}, name
        assert rule["annotations"]["summary"], name
    # Operators look each alert up by name in the runbook, and its runbook_url leads there.
    runbook = (REPO / "docs" / "operations.md").read_text()
    anchors = set(re.findall(r'<a id="([^"]+)"></a>', runbook))
    for name, rule in alerts.items():
        assert name in runbook, f"{name} is not explained in docs/operations.md"
        url = rule["annotations"].get("runbook_url", "")
        path, _, anchor = url.partition("#")
        assert path == "docs/operations.md" and anchor in anchors, f"{name}: {url!r}"
        rest = runbook.split(f'<a id="{anchor}"></a>', 1)[1]
        section = rest[rest.index("### "):].split("\n### ", 1)[0]
        assert name in section, f"{name}: its runbook_url leads to another section"


def test_what_the_operator_sees_is_the_coordinators_metrics_only() -> None:
    """The operator's dashboard and alert rules query coordinator series (and the
    coordinator's scrape job) only: nothing that needs a hospital's own /metrics, where
    its exact record and patient counts are. A hospital's query only its agent's."""
    coordinator = exported_names(CoordinatorMetrics().registry)
    site = exported_names(SiteMetrics("any").registry)
    assert not coordinator & site
    recorded = {r["record"] for r in rules(OPERATOR) if "record" in r}
    operator = dashboard_expressions(OPERATOR_DASHBOARD) + alert_expressions(OPERATOR)
    queried = queried_names(operator)
    assert queried and queried <= coordinator, sorted(queried - coordinator)
    assert not any("medfed_site_" in expr for expr in operator)
    assert {job for expr in operator for job in JOB.findall(expr)} <= {"medfed-coordinator"}
    assert all(name.startswith("medfed:coordinator_") for name in recorded)
    hospital = dashboard_expressions(HOSPITAL_DASHBOARD) + alert_expressions(HOSPITAL)
    queried = queried_names(hospital)
    assert queried and queried <= site, sorted(queried - site)
    assert {job for expr in hospital for job in JOB.findall(expr)} <= {"medfed-site"}
    # The hospital's dashboard is where its counts are, and only there.
    counts = {"medfed_site_training_samples", "medfed_site_training_patients"}
    assert counts <= queried_names(dashboard_expressions(HOSPITAL_DASHBOARD))


@needs_promtool
@pytest.mark.parametrize("dashboard", [OPERATOR_DASHBOARD, HOSPITAL_DASHBOARD],
                         ids=["operator", "hospital"])
def test_dashboard_queries_are_valid_promql(dashboard: Path, tmp_path: Path) -> None:
    """promtool parses every dashboard query (as a recording rule)."""
    exprs = [e.replace("$__rate_interval", "5m").replace("$site", ".*")
             .replace("$instance", ".*") for e in dashboard_expressions(dashboard)]
    recording = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": expr} for i, expr in enumerate(exprs)
    ]}]}
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump(recording))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in result.stdout


@pytest.mark.parametrize(("dashboard", "filters"), [
    (OPERATOR_DASHBOARD, ("site", "instance")), (HOSPITAL_DASHBOARD, ("instance",)),
], ids=["operator", "hospital"])
def test_dashboards_have_datasource_and_filter_variables(
    dashboard: Path, filters: tuple[str, ...]
) -> None:
    """Imported into another Grafana, a dashboard asks for its Prometheus ($datasource);
    the operator's filters every per-site series by $site and $instance, the hospital's
    every series by $instance."""
    loaded = json.loads(dashboard.read_text())
    variables = {v["name"]: v for v in loaded["templating"]["list"]}
    assert set(variables) == {"datasource", *filters}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in filters:
        assert variables[name]["type"] == "query"
        assert variables[name]["datasource"]["uid"] == "${datasource}"
        assert variables[name]["includeAll"] and variables[name]["multi"]
    for panel in loaded["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            for series in re.findall(r"\bmedfed_[a-z_]+\{[^}]*\}|\bmedfed_[a-z_]+",
                                     target["expr"]):
                assert 'instance=~"$instance"' in series, series
                per_site = series.startswith(("medfed_coordinator_site_",
                                              "medfed_coordinator_calls_refused",
                                              "medfed_coordinator_round_reports_refused",
                                              "medfed_coordinator_misbehaving"))
                if "site" in filters and per_site:
                    assert 'site=~"$site"' in series, series


def test_dashboards_cover_the_requested_panels() -> None:
    operator = json.loads(OPERATOR_DASHBOARD.read_text())
    assert operator["title"] == "medfed federation"
    queried = " ".join(dashboard_expressions(OPERATOR_DASHBOARD))
    for metric in ("medfed_coordinator_rounds_total", "medfed_coordinator_phase_duration_seconds",
                   "medfed_coordinator_dropouts_total", "medfed_coordinator_site_epsilon_spent",
                   "medfed_coordinator_site_epsilon_budget", "medfed_coordinator_model_auc_ratio",
                   "medfed_coordinator_quorum_margin_sites",
                   "medfed_coordinator_received_bytes_total",
                   "medfed_coordinator_grpc_requests_total",
                   "medfed_coordinator_site_last_contact_timestamp_seconds"):
        assert metric in queried, metric
    hospital = " ".join(dashboard_expressions(HOSPITAL_DASHBOARD))
    for metric in ("medfed_site_training_duration_seconds", "medfed_site_rounds_total",
                   "medfed_site_epsilon_spent", "medfed_site_connected",
                   "medfed_site_device_info"):
        assert metric in hospital, metric
    datasource = yaml.safe_load(
        (REPO / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text()
    )["datasources"][0]
    for path in (OPERATOR_DASHBOARD, HOSPITAL_DASHBOARD):
        dashboard = json.loads(path.read_text())
        # Panels query $datasource, whose default is the provisioned Prometheus.
        variables = {v["name"]: v for v in dashboard["templating"]["list"]}
        assert variables["datasource"]["current"]["value"] == datasource["uid"]
        ids = [panel["id"] for panel in dashboard["panels"]]
        assert len(ids) == len(set(ids))
    assert json.loads(HOSPITAL_DASHBOARD.read_text())["uid"] != operator["uid"]


# --------------------------------------------------------------------------- live


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """/metrics text of a coordinator (HTTPS, scraped with a monitor certificate) and a
    site agent after round 1 completed, with the coordinator still serving.

    The coordinator plans 2 rounds with min_sites 3; "rural" leaves after round 1, so
    round 2 never starts and everybody stays up, connected, with round 1's metrics.
    """
    fed = Federation(tmp_path_factory.mktemp("monitoring"), SITES)
    pki.issue_monitor(fed.pki, MONITOR, now=dt.datetime.now(dt.UTC))
    try:
        coordinator = fed.start_coordinator(
            "--model-dim", "1000", "--rounds", "2", "--min-sites", "3",
            "--phase-seconds", "10", "--train-seconds", "30", "--selection-seconds", "0.5",
            "--linger-seconds", "60", "--metrics-tls",
        )
        listening = coordinator.wait_event("listening")
        assert listening["metrics_tls"] is True
        coordinator_port = int(listening["metrics_port"])
        fed.start_site("paediatric")
        fed.start_site("geriatric")
        fed.start_site("rural", "--exit-after-rounds", "1")
        site_port = int(fed.site_procs["paediatric"].wait_event("started")["metrics_port"])
        coordinator.wait_log("round 1 completed", timeout=120)
        fed.site_procs["paediatric"].wait_event("site_round_done", round_number=1, timeout=60)
        yield {
            "coordinator": scrape_coordinator(fed.pki, coordinator_port),
            "site": scrape(f"http://127.0.0.1:{site_port}/metrics"),
            "coordinator_port": coordinator_port,
            "pki": fed.pki,
            "root": fed.root,
        }
    finally:
        # Coordinator first: its shutdown ends the sites' long-polls, so they exit promptly.
        if fed.coordinator is not None:
            fed.coordinator.stop()
        fed.stop()


def scrape(url: str, context: ssl.SSLContext | None = None) -> str:
    with urllib.request.urlopen(url, timeout=10, context=context) as response:
        assert response.status == 200
        return str(response.read().decode())


def scrape_coordinator(pki_dir: Path, port: int) -> str:
    """As Prometheus does: HTTPS, the CA as the only trust root, a monitor certificate."""
    context = ssl.create_default_context(cafile=str(pki_dir / "ca.crt"))
    context.load_cert_chain(*(str(p) for p in pki.monitor_paths(pki_dir, MONITOR)))
    return scrape(f"https://127.0.0.1:{port}/metrics", context)


@pytest.mark.e2e
@needs_promtool
@pytest.mark.parametrize("service", ["coordinator", "site"])
def test_live_metrics_pass_promtool_check_metrics(live: dict[str, Any], service: str) -> None:
    result = promtool("check", "metrics", stdin=live[service])
    assert result.returncode == 0, result.stdout + result.stderr
    # promtool prints lint problems but still exits 0 for some of them: demand silence.
    assert result.stdout.strip() == "" and result.stderr.strip() == "", (
        result.stdout + result.stderr
    )


@pytest.mark.e2e
def test_live_metrics_are_prefixed_and_documented(live: dict[str, Any]) -> None:
    for service in ("coordinator", "site"):
        families = re.findall(r"^# HELP (\S+) (.*)$", live[service], flags=re.MULTILINE)
        assert families, service
        for name, help_text in families:
            assert name.startswith(f"medfed_{service}_"), name
            assert help_text.strip(), f"{name} has no HELP text"


@pytest.mark.e2e
def test_every_metric_queried_by_dashboards_and_alerts_exists_live(
    live: dict[str, Any],
) -> None:
    for service, dashboard, folder in (("coordinator", OPERATOR_DASHBOARD, OPERATOR),
                                       ("site", HOSPITAL_DASHBOARD, HOSPITAL)):
        exposed = sample_names(live[service])
        queried = queried_names(dashboard_expressions(dashboard) + alert_expressions(folder))
        # A labelled family prints no sample until first used (no call was refused
        # here; the transport sites run no DP-SGD): declared is exported.
        unused = {name for name in queried - exposed
                  if re.search(rf"^# TYPE {re.escape(name)} \w+$", live[service], re.M)}
        missing = sorted(queried - exposed - unused)
        assert missing == [], f"{service}: queried but not exported: {missing}"


@pytest.mark.e2e
def test_live_values_reflect_the_completed_round(live: dict[str, Any]) -> None:
    coordinator, site = live["coordinator"], live["site"]

    def value(text: str, series: str) -> float:
        match = re.search(rf"^{re.escape(series)} (\S+)$", text, flags=re.MULTILINE)
        assert match, f"{series} not exported"
        return float(match.group(1))

    assert value(coordinator, 'medfed_coordinator_rounds_total{outcome="completed"}') == 1.0
    assert value(coordinator, 'medfed_coordinator_rounds_total{outcome="aborted"}') == 0.0
    assert value(coordinator, "medfed_coordinator_sites_enrolled") == 3.0
    # 3 survivors of a secure round: the margin is a real number, not the NaN placeholder.
    assert value(coordinator, "medfed_coordinator_quorum_margin_sites") >= 0
    assert value(coordinator, "medfed_coordinator_received_bytes_total") >= 3 * 1000 * 4
    # The test trainer keeps no ledger (budget 0); the per-site series exist all the same.
    now = time.time()
    for site_id in SITES:
        for gauge in ("budget", "spent"):
            series = f'medfed_coordinator_site_epsilon_{gauge}{{site="{site_id}"}}'
            assert value(coordinator, series) >= 0
        series = f'medfed_coordinator_site_last_contact_timestamp_seconds{{site="{site_id}"}}'
        assert 0 <= now - value(coordinator, series) < 300
    assert 0.0 <= value(coordinator, "medfed_coordinator_model_auc_ratio") <= 1.0
    assert value(site, 'medfed_site_rounds_total{outcome="completed"}') == 1.0
    assert value(site, "medfed_site_connected") == 1.0
    assert value(site, "medfed_site_training_duration_seconds_count") == 1.0
    assert value(site, "medfed_site_training_samples") > 0
    # Revocation and expiry: real timestamps, in the future.
    assert value(coordinator, "medfed_coordinator_crl_next_update_timestamp_seconds") > now
    assert value(site, "medfed_site_crl_next_update_timestamp_seconds") > now
    for kind, name in (("ca", "ca"), ("coordinator", "coordinator"), ("site", "paediatric")):
        series = (f'medfed_coordinator_certificate_expiry_timestamp_seconds'
                  f'{{kind="{kind}",name="{name}"}}')
        assert value(coordinator, series) > now
    for name in ("site", "ca"):
        series = f'medfed_site_certificate_expiry_timestamp_seconds{{certificate="{name}"}}'
        assert value(site, series) > now
    assert re.search(r'^medfed_site_device_info\{device="(cpu|cuda[:0-9]*)"\} 1\.0$', site,
                     flags=re.MULTILINE)


def _input_series(exposition: str, *, job: str, instance: str, minutes: int,
                  extra: str = "") -> list[dict[str, str]]:
    """A /metrics text as promtool input series, each value held for `minutes`; but a
    site's last contact follows the test's clock (time() is 0 at 0m), as a site calling
    all along moves it (held, the live unix time would be far in the test's future)."""
    series = []
    for line in exposition.splitlines():
        if not line or line.startswith("#"):
            continue
        match = re.fullmatch(r"([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)", line)
        assert match, line
        name, labels, raw = match.groups()
        value = float(raw)
        own = f'job="{job}",instance="{instance}"{extra}'
        if name == "medfed_coordinator_site_last_contact_timestamp_seconds":
            values = f"0+60x{minutes}"
        else:
            text = "NaN" if value != value else f"{value:f}"
            values = " ".join([text] * (minutes + 1))
        series.append({"series": f"{name}{{{own}{',' + labels if labels else ''}}}",
                       "values": values})
    return series


def _alert_names(folder: Path) -> list[str]:
    return [r["alert"] for r in rules(folder) if "alert" in r]


def _expected(rule: dict[str, Any], labels: dict[str, str],
              annotations: dict[str, str]) -> dict[str, Any]:
    return {"exp_labels": {"severity": rule["labels"]["severity"], **labels},
            "exp_annotations": {"runbook_url": rule["annotations"]["runbook_url"],
                                **annotations}}


@pytest.mark.e2e
@needs_promtool
def test_no_alert_fires_on_a_healthy_three_site_federation(
    live: dict[str, Any], tmp_path: Path
) -> None:
    """The compose demo's shape (a coordinator, three sites that each refuse a sum of
    two, every round at the quorum threshold): the live /metrics after a completed secure
    round, scraped for 30 minutes as the shipped configs label them (the coordinator by
    the operator's Prometheus, a site agent by its hospital's), fire no alert. The same
    metrics with one site silent fire MedfedSiteSilent at the operator, and with the
    agent's scrape failing MedfedSiteDown at the hospital."""
    minutes = 30
    coordinator = "coordinator:9464"
    agent = "127.0.0.1:9465"

    def operator_series(silent: bool) -> list[dict[str, str]]:
        found = _input_series(live["coordinator"], job="medfed-coordinator",
                              instance=coordinator, minutes=minutes)
        found.append({"series": f'up{{job="medfed-coordinator",instance="{coordinator}"}}',
                      "values": f"1x{minutes}"})
        if silent:
            for entry in found:
                if entry["series"].startswith(
                        'medfed_coordinator_site_last_contact_timestamp_seconds') and \
                        'site="rural"' in entry["series"]:
                    entry["values"] = f"0+60x10 600x{minutes - 10}"
        return found

    def hospital_series(up: str) -> list[dict[str, str]]:
        found = _input_series(live["site"], job="medfed-site", instance=agent,
                              minutes=minutes)
        found.append({"series": f'up{{job="medfed-site",instance="{agent}"}}', "values": up})
        return found

    (silent_rule,) = [r for r in rules(OPERATOR) if r.get("alert") == "MedfedSiteSilent"]
    (down,) = [r for r in rules(HOSPITAL) if r.get("alert") == "MedfedSiteDown"]
    suites = {
        OPERATOR: [
            {"name": "healthy federation: no operator alert", "interval": "1m",
             "input_series": operator_series(silent=False),
             "alert_rule_test": [{"eval_time": f"{t}m", "alertname": name, "exp_alerts": []}
                                 for name in _alert_names(OPERATOR) for t in (5, 15, minutes)]},
            {"name": "one site stops calling: MedfedSiteSilent", "interval": "1m",
             "input_series": operator_series(silent=True),
             "alert_rule_test": [{
                 "eval_time": f"{minutes}m", "alertname": "MedfedSiteSilent",
                 "exp_alerts": [_expected(
                     silent_rule,
                     {"job": "medfed-coordinator", "instance": coordinator, "site": "rural"},
                     {"summary": "Site rural has not called the coordinator for over 5 "
                                 "minutes",
                      "description": silent_rule["annotations"]["description"]
                      .replace("{{ $labels.site }}", "rural")
                      .replace("{{ $value | humanizeDuration }}", "20m 0s")},
                 )],
             }]},
        ],
        HOSPITAL: [
            {"name": "healthy agent: no hospital alert", "interval": "1m",
             "input_series": hospital_series(f"1x{minutes}"),
             "alert_rule_test": [{"eval_time": f"{t}m", "alertname": name, "exp_alerts": []}
                                 for name in _alert_names(HOSPITAL) for t in (5, 15, minutes)]},
            {"name": "the agent's scrape fails: MedfedSiteDown", "interval": "1m",
             "input_series": hospital_series(f"1x10 0x{minutes - 10}"),
             "alert_rule_test": [{
                 "eval_time": f"{minutes}m", "alertname": "MedfedSiteDown",
                 "exp_alerts": [_expected(
                     down, {"job": "medfed-site", "instance": agent},
                     {"summary": down["annotations"]["summary"].replace(
                         "{{ $labels.instance }}", agent),
                      "description": down["annotations"]["description"]},
                 )],
             }]},
        ],
    }
    for folder, tests in suites.items():
        path = tmp_path / f"live_{folder.name}_alerts_test.yml"
        path.write_text(yaml.safe_dump({"rule_files": [str(folder / "alerts.yml")],
                                        "evaluation_interval": "1m", "tests": tests},
                                       sort_keys=False))
        result = promtool("test", "rules", str(path))
        assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    # The shape the alert's expression is about: the last secure round had no spare site.
    margin = re.search(r"^medfed_coordinator_quorum_margin_sites (\S+)$",
                       live["coordinator"], re.M)
    assert margin and float(margin.group(1)) == 0.0


@pytest.mark.e2e
@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (Debian package "
                    "`prometheus`; .ci/scripts/install-tools.sh)")
def test_prometheus_scrapes_the_coordinator_with_the_shipped_tls_job(
    live: dict[str, Any], tmp_path: Path
) -> None:
    """A real Prometheus with deploy/prometheus/prometheus.yml as shipped, but for the
    target (the live coordinator), the /pki/ files (a monitor certificate of the live
    federation) and a 1 s scrape interval: it scrapes the coordinator over mutual TLS."""
    assert PROMETHEUS is not None
    config = _with_test_pki((OPERATOR / "prometheus.yml").read_text(), live["pki"])
    config = config.replace('"coordinator:9464"', f'"127.0.0.1:{live["coordinator_port"]}"')
    config = config.replace("scrape_interval: 15s", "scrape_interval: 1s")
    shutil.copy(OPERATOR / "alerts.yml", tmp_path / "alerts.yml")
    (tmp_path / "prometheus.yml").write_text(config)
    web = f"127.0.0.1:{free_port()}"
    server = ManagedProcess("prometheus", [
        PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
        f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address={web}",
    ], log_dir=tmp_path / "logs", cwd=tmp_path)
    try:
        server.wait_log("Server is ready to receive web requests", timeout=120)
        target = _first_scrape(web, deadline=time.monotonic() + 120)
        assert target["health"] == "up", target.get("lastError")
        query = urllib.parse.quote('medfed_coordinator_rounds_total{outcome="completed"}')
        with urllib.request.urlopen(f"http://{web}/api/v1/query?query={query}",
                                    timeout=10) as response:
            result = json.loads(response.read())["data"]["result"]
        assert [float(r["value"][1]) for r in result] == [1.0]
    finally:
        server.stop()


def _first_scrape(web: str, *, deadline: float) -> dict[str, Any]:
    """The coordinator target once Prometheus has discovered and scraped it (health no
    longer unknown)."""
    pause = threading.Event()
    while True:
        with urllib.request.urlopen(f"http://{web}/api/v1/targets", timeout=10) as response:
            targets = json.loads(response.read())["data"]["activeTargets"]
        found = [t for t in targets if t["labels"]["job"] == "medfed-coordinator"]
        if (found and found[0]["health"] != "unknown") or time.monotonic() > deadline:
            (target,) = found
            return dict(target)
        pause.wait(0.2)
