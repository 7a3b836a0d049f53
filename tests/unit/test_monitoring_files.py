"""Prometheus rules (promtool) and the Grafana dashboard: built only on series ibex exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from ibex.ops.metrics import Metrics
from ibex.ops.supervisor_metrics import WorkerRestarts

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "ibex-context.rules.yml"
RULES_TEST = Path(__file__).parent / "prometheus" / "rules_test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "ibex-context.json"
SCRAPE = ROOT / "deploy" / "prometheus" / "scrape-config.yml"
DEPLOYMENT = ROOT / "deploy" / "kubernetes" / "deployment.yaml"

# A PromQL identifier; `ibex_`/`ibex:` names are checked, the rest are functions,
# keywords and labels.
_NAME = re.compile(r"(?<![A-Za-z0-9_:\"$])(ibex[_:][A-Za-z0-9_:]*)")


def exported_series() -> set[str]:
    """Every sample name the daemon (and the worker supervisor) can expose."""
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    metrics.set_token_cache_source(lambda: (0, 0))
    registry.register(WorkerRestarts())
    names: set[str] = set()
    for family in registry.collect():
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names |= {family.name + s for s in ("_bucket", "_sum", "_count")}
        else:
            names.add(family.name)
    return names


def yaml_load(path: Path) -> Any:
    yaml = pytest.importorskip("yaml", reason="PyYAML not installed (needed to parse rules)")
    return yaml.safe_load(path.read_text())


def rules() -> list[dict[str, Any]]:
    return [rule for group in yaml_load(RULES)["groups"] for rule in group["rules"]]


def recorded() -> set[str]:
    return {r["record"] for r in rules() if "record" in r}


def dashboard_exprs() -> Iterator[str]:
    dash = json.loads(DASHBOARD.read_text())
    for panel in dash["panels"]:
        for target in panel["targets"]:
            yield target["expr"]
    for variable in dash["templating"]["list"]:
        if variable["type"] == "query":
            yield variable["query"]["query"]


def unknown_names(expr: str, known: set[str]) -> set[str]:
    return {name for name in _NAME.findall(expr) if name not in known}


def test_exported_series_include_what_the_rules_watch() -> None:
    names = exported_series()
    for name in (
        "ibex_grpc_request_duration_seconds_bucket",
        "ibex_grpc_requests_total",
        "ibex_degradation_total",
        "ibex_shed_requests_total",
        "ibex_branch_outcomes_total",
        "ibex_worker_restarts_total",
    ):
        assert name in names


def test_rules_use_only_exported_series_and_defined_recordings() -> None:
    known = exported_series() | recorded()
    for rule in rules():
        assert unknown_names(rule["expr"], known) == set(), rule.get("record") or rule["alert"]
        if "alert" in rule:
            assert rule["labels"]["severity"] in ("page", "ticket"), rule["alert"]
            assert rule["annotations"]["summary"], rule["alert"]


def test_every_alert_is_tested_firing() -> None:
    tests = yaml_load(RULES_TEST)["tests"]
    fired = {
        case["alertname"]
        for test in tests
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    alerts = {r["alert"] for r in rules() if "alert" in r}
    assert alerts == fired


def test_dashboard_uses_only_exported_series_and_defined_recordings() -> None:
    known = exported_series() | recorded()
    exprs = list(dashboard_exprs())
    assert len(exprs) >= 10
    for expr in exprs:
        assert _NAME.search(expr), expr  # every query reads some ibex series
        assert unknown_names(expr, known) == set(), expr


def test_dashboard_covers_what_a_proxy_team_pages_on() -> None:
    text = "\n".join(dashboard_exprs())
    for name in (
        "ibex:assemble_latency_seconds:p99_5m",
        "ibex:degradation:ratio_rate5m",
        "ibex_shed_requests_total",
        "ibex_branch_outcomes_total",
        "ibex_worker_restarts_total",
    ):
        assert name in text


def test_name_extraction_sees_through_promql() -> None:
    expr = 'sum by (le) (rate(ibex_x_bucket{job=~"$job",q="ibex_not_a_name"}[5m])) / ibex:y'
    assert set(_NAME.findall(expr)) == {"ibex_x_bucket", "ibex:y"}


PROMTOOL = shutil.which("promtool")


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian package prometheus)")
def test_promtool_checks_the_rules() -> None:
    assert PROMTOOL is not None
    proc = subprocess.run(
        [PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian package prometheus)")
def test_promtool_unit_tests_of_the_rules_pass() -> None:
    assert PROMTOOL is not None
    proc = subprocess.run(
        [PROMTOOL, "test", "rules", str(RULES_TEST)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=RULES_TEST.parent,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# -- scraping: every job sends the bearer token /metrics asks for ---------------------------


def test_every_scrape_job_sends_a_bearer_token_from_a_file() -> None:
    jobs = yaml_load(SCRAPE)["scrape_configs"]
    assert {j["job_name"] for j in jobs} == {"ibex-context", "ibex-context-systemd"}
    files = set()
    for job in jobs:
        auth = job["authorization"]
        assert auth.get("type", "Bearer") == "Bearer", job["job_name"]
        assert "credentials" not in auth  # never inline in the config
        files.add(auth["credentials_file"])
    assert len(files) == 1


def test_the_kubernetes_job_keeps_the_pods_metrics_port() -> None:
    (job,) = [j for j in yaml_load(SCRAPE)["scrape_configs"] if j["job_name"] == "ibex-context"]
    pod = yaml_load(DEPLOYMENT)["spec"]["template"]
    keep = {
        tuple(r["source_labels"]): r["regex"]
        for r in job["relabel_configs"]
        if r.get("action") == "keep"
    }
    app = pod["metadata"]["labels"]["app.kubernetes.io/name"]
    assert keep[("__meta_kubernetes_pod_label_app_kubernetes_io_name",)] == app
    port_names = {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
    assert keep[("__meta_kubernetes_pod_container_port_name",)] in port_names
    assert job["metrics_path"] == "/metrics"


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian package prometheus)")
def test_promtool_checks_the_scrape_config(tmp_path: Path) -> None:
    """Syntax only: the token file exists on the Prometheus host, not here. Debian's
    promtool is built without Kubernetes discovery; then the job is checked with a
    static target in its place."""
    assert PROMTOOL is not None

    def check(path: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [PROMTOOL, "check", "config", "--syntax-only", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
        )

    proc = check(SCRAPE)
    if "field kubernetes_sd_configs not found" in proc.stdout + proc.stderr:
        yaml = pytest.importorskip("yaml")
        doc = yaml_load(SCRAPE)
        for job in doc["scrape_configs"]:
            if job.pop("kubernetes_sd_configs", None) is not None:
                job["static_configs"] = [{"targets": ["ibex-context:9464"]}]
        copy = tmp_path / SCRAPE.name
        copy.write_text(yaml.safe_dump(doc))
        proc = check(copy)
    assert proc.returncode == 0, proc.stdout + proc.stderr
