"""Monitoring files against the real product.

`promtool` validates the Prometheus config, the alert rules (and their unit tests in
deploy/prometheus/alerts_test.yml) and the LIVE /metrics output of a real coordinator
and a real site agent, started as OS processes after one secure round completed. Every
medfed_* series that the Grafana dashboard or an alert rule queries must exist in that
output, so a renamed metric breaks this test rather than a dashboard in production.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.e2e.harness import REPO, Federation

PROMETHEUS = REPO / "deploy" / "prometheus"
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "medfed-federation.json"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool not installed (Debian package `prometheus`; .ci/scripts/install-tools.sh)",
)
METRIC_NAME = re.compile(r"\bmedfed_[a-z0-9_]+")
SITES = ["paediatric", "geriatric", "rural"]


def promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], input=stdin, capture_output=True, text=True,
                          cwd=PROMETHEUS, timeout=120)


def dashboard_expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            exprs.append(target["expr"])
    return exprs


def alert_expressions() -> list[str]:
    rules = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())
    return [rule["expr"] for group in rules["groups"] for rule in group["rules"]]


def sample_names(exposition: str) -> set[str]:
    """Names of the samples in a text exposition (with _bucket/_sum/_count/_total)."""
    names = set()
    for line in exposition.splitlines():
        if line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


# --------------------------------------------------------------------------- static


@needs_promtool
def test_prometheus_config_and_rules_pass_promtool() -> None:
    config = promtool("check", "config", "prometheus.yml")
    assert config.returncode == 0, config.stdout + config.stderr
    rules = promtool("check", "rules", "alerts.yml")
    assert rules.returncode == 0, rules.stdout + rules.stderr
    count = sum(len(g["rules"]) for g in
                yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"])
    assert f"SUCCESS: {count} rules found" in rules.stdout


@needs_promtool
def test_alert_rule_unit_tests_pass() -> None:
    result = promtool("test", "rules", "alerts_test.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_the_issue_asks_for_is_defined() -> None:
    alerts = {
        rule["alert"]: rule
        for group in yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"]
        for rule in group["rules"] if "alert" in rule
    }
    assert {"MedfedSiteBudgetAlmostSpent", "MedfedSiteLedgerBudgetAlmostSpent", "MedfedSiteDown",
            "MedfedSiteDisconnected", "MedfedRoundsFailing",
            "MedfedQuorumMarginLow", "MedfedCrlExpiresSoon", "MedfedSiteCrlExpiresSoon",
            "MedfedCertificateExpiresSoon", "MedfedSiteCertificateExpiresSoon"} <= set(alerts)
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


@needs_promtool
def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    """promtool parses every dashboard query (as a recording rule)."""
    exprs = [e.replace("$__rate_interval", "5m").replace("$site", ".*")
             .replace("$instance", ".*") for e in dashboard_expressions()]
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": expr} for i, expr in enumerate(exprs)
    ]}]}
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in result.stdout


def test_dashboard_has_datasource_site_and_instance_variables() -> None:
    """Imported into another Grafana, the dashboard asks for its Prometheus ($datasource)
    and filters every site series by $site and $instance."""
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("site", "instance"):
        assert variables[name]["type"] == "query"
        assert variables[name]["datasource"]["uid"] == "${datasource}"
        assert variables[name]["includeAll"] and variables[name]["multi"]
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            for series in re.findall(r"\bmedfed_site_[a-z_]+(?:\{[^}]*\})?", target["expr"]):
                assert 'site=~"$site"' in series and 'instance=~"$instance"' in series, series


def test_dashboard_covers_the_requested_panels() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] == "medfed federation"
    queried = " ".join(dashboard_expressions())
    for metric in ("medfed_coordinator_rounds_total", "medfed_coordinator_phase_duration_seconds",
                   "medfed_coordinator_dropouts_total", "medfed_coordinator_site_epsilon_spent",
                   "medfed_coordinator_site_epsilon_budget", "medfed_coordinator_model_auc_ratio",
                   "medfed_coordinator_quorum_margin_sites",
                   "medfed_coordinator_received_bytes_total",
                   "medfed_coordinator_grpc_requests_total",
                   "medfed_site_training_duration_seconds"):
        assert metric in queried, metric
    datasource = yaml.safe_load(
        (REPO / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text()
    )["datasources"][0]
    # Panels query $datasource, whose default is the provisioned Prometheus.
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["current"]["value"] == datasource["uid"]
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))


# --------------------------------------------------------------------------- live


@pytest.fixture(scope="module")
def live_metrics(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """/metrics text of a coordinator and a site agent after round 1 completed.

    The coordinator plans 2 rounds with min_sites 3; "rural" leaves after round 1, so
    round 2 never starts and everybody stays up, connected, with round 1's metrics.
    """
    fed = Federation(tmp_path_factory.mktemp("monitoring"), SITES)
    try:
        coordinator = fed.start_coordinator(
            "--model-dim", "1000", "--rounds", "2", "--min-sites", "3",
            "--phase-seconds", "10", "--train-seconds", "30", "--selection-seconds", "0.5",
            "--linger-seconds", "60",
        )
        coordinator_port = int(coordinator.wait_event("listening")["metrics_port"])
        fed.start_site("paediatric")
        fed.start_site("geriatric")
        fed.start_site("rural", "--exit-after-rounds", "1")
        site_port = int(fed.site_procs["paediatric"].wait_event("started")["metrics_port"])
        coordinator.wait_log("round 1 completed", timeout=120)
        fed.site_procs["paediatric"].wait_event("site_round_done", round_number=1, timeout=60)
        yield {
            "coordinator": scrape(coordinator_port),
            "site": scrape(site_port),
        }
    finally:
        # Coordinator first: its shutdown ends the sites' long-polls, so they exit promptly.
        if fed.coordinator is not None:
            fed.coordinator.stop()
        fed.stop()


def scrape(port: int) -> str:
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        return response.read().decode()


@pytest.mark.e2e
@needs_promtool
@pytest.mark.parametrize("service", ["coordinator", "site"])
def test_live_metrics_pass_promtool_check_metrics(
    live_metrics: dict[str, str], service: str
) -> None:
    result = promtool("check", "metrics", stdin=live_metrics[service])
    assert result.returncode == 0, result.stdout + result.stderr
    # promtool prints lint problems but still exits 0 for some of them: demand silence.
    assert result.stdout.strip() == "" and result.stderr.strip() == "", (
        result.stdout + result.stderr
    )


@pytest.mark.e2e
def test_live_metrics_are_prefixed_and_documented(live_metrics: dict[str, str]) -> None:
    for service, text in live_metrics.items():
        families = re.findall(r"^# HELP (\S+) (.*)$", text, flags=re.MULTILINE)
        assert families, service
        for name, help_text in families:
            assert name.startswith(f"medfed_{service}_"), name
            assert help_text.strip(), f"{name} has no HELP text"


@pytest.mark.e2e
def test_every_metric_queried_by_dashboard_and_alerts_exists_live(
    live_metrics: dict[str, str],
) -> None:
    exposed = sample_names(live_metrics["coordinator"]) | sample_names(live_metrics["site"])
    queried = {
        name
        for expr in dashboard_expressions() + alert_expressions()
        for name in METRIC_NAME.findall(expr)
    }
    assert any(n.startswith("medfed_coordinator_") for n in queried)
    assert any(n.startswith("medfed_site_") for n in queried)
    missing = sorted(queried - exposed)
    assert missing == [], f"queried but not exported: {missing}"


@pytest.mark.e2e
def test_live_values_reflect_the_completed_round(live_metrics: dict[str, str]) -> None:
    coordinator, site = live_metrics["coordinator"], live_metrics["site"]

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
    for site_id in SITES:
        for gauge in ("budget", "spent"):
            series = f'medfed_coordinator_site_epsilon_{gauge}{{site="{site_id}"}}'
            assert value(coordinator, series) >= 0
    assert 0.0 <= value(coordinator, "medfed_coordinator_model_auc_ratio") <= 1.0
    assert value(site, 'medfed_site_rounds_total{outcome="completed"}') == 1.0
    assert value(site, "medfed_site_connected") == 1.0
    assert value(site, "medfed_site_training_duration_seconds_count") == 1.0
    assert value(site, "medfed_site_training_samples") > 0
    # Revocation and expiry: real timestamps, in the future.
    now = time.time()
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
    """A /metrics text as promtool input series, each value held for `minutes`."""
    series = []
    for line in exposition.splitlines():
        if not line or line.startswith("#"):
            continue
        match = re.fullmatch(r"([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)", line)
        assert match, line
        name, labels, raw = match.groups()
        value = float(raw)
        text = "NaN" if value != value else f"{value:f}"
        own = f'job="{job}",instance="{instance}"{extra}'
        series.append({"series": f"{name}{{{own}{',' + labels if labels else ''}}}",
                       "values": " ".join([text] * (minutes + 1))})
    return series


def _alert_names() -> list[str]:
    rules = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())
    return [r["alert"] for group in rules["groups"] for r in group["rules"] if "alert" in r]


@pytest.mark.e2e
@needs_promtool
def test_no_alert_fires_on_a_healthy_three_site_federation(
    live_metrics: dict[str, str], tmp_path: Path
) -> None:
    """The compose demo's shape (a coordinator, three sites that each refuse a sum of
    two, every round at the quorum threshold): the live /metrics after a completed secure
    round, scraped for 30 minutes as deploy/prometheus/prometheus.yml labels them, fire no
    alert. The same metrics with one site's scrape failing fire MedfedSiteDown."""
    minutes = 30
    sites = [f"site-{site}:9465" for site in SITES]

    def series(rural_up: str) -> list[dict[str, str]]:
        found = _input_series(live_metrics["coordinator"], job="medfed-coordinator",
                              instance="coordinator:9464", minutes=minutes)
        found.append({"series": 'up{job="medfed-coordinator",instance="coordinator:9464"}',
                      "values": f"1x{minutes}"})
        for site, instance in zip(SITES, sites):
            found += _input_series(live_metrics["site"], job="medfed-sites",
                                   instance=instance, minutes=minutes,
                                   extra=f',site="{site}"')
            up = rural_up if site == "rural" else f"1x{minutes}"
            found.append({"series": f'up{{job="medfed-sites",instance="{instance}",'
                                    f'site="{site}"}}', "values": up})
        return found

    rules = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())
    (down,) = [r for g in rules["groups"] for r in g["rules"] if r.get("alert") == "MedfedSiteDown"]
    instance = "site-rural:9465"
    tests = {
        "rule_files": [str(PROMETHEUS / "alerts.yml")],
        "evaluation_interval": "1m",
        "tests": [
            {"name": "healthy federation: no alert", "interval": "1m",
             "input_series": series(f"1x{minutes}"),
             "alert_rule_test": [{"eval_time": f"{t}m", "alertname": name, "exp_alerts": []}
                                 for name in _alert_names() for t in (5, 15, minutes)]},
            {"name": "one site's scrape fails: MedfedSiteDown", "interval": "1m",
             "input_series": series(f"1x10 0x{minutes - 10}"),
             "alert_rule_test": [{
                 "eval_time": f"{minutes}m", "alertname": "MedfedSiteDown",
                 "exp_alerts": [{
                     "exp_labels": {"severity": down["labels"]["severity"],
                                    "job": "medfed-sites", "instance": instance,
                                    "site": "rural"},
                     "exp_annotations": {
                         "runbook_url": down["annotations"]["runbook_url"],
                         "summary": down["annotations"]["summary"].replace(
                             "{{ $labels.instance }}", instance),
                         "description": down["annotations"]["description"]},
                 }],
             }]},
        ],
    }
    path = tmp_path / "live_alerts_test.yml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False))
    result = promtool("test", "rules", str(path))
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    # The shape the alert's expression is about: the last secure round had no spare site.
    margin = re.search(r"^medfed_coordinator_quorum_margin_sites (\S+)$",
                       live_metrics["coordinator"], re.M)
    assert margin and float(margin.group(1)) == 0.0
