"""The Grafana dashboard and the alert rules name only series jobstream exports: the names
come from the real metrics registry (jobstream/metrics.py) scraping this test's Postgres and
Kafka, and every panel query is parsed by promtool."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from jobstream import metrics
from jobstream.settings import Settings
from jobstream.store import Store
from tests.promql import DASHBOARDS, alert_rules, check_parses, panel_exprs, series_names

pytestmark = pytest.mark.integration

#: Series the rules may name although the registry does not export them (none: the auditor's
#: jobstream_verify_broken and the Debezium slot gauges have landed and are checked like the
#: rest).
PENDING: set[str] = set()
#: Sample names per family type, as the text exposition writes them.
_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "gaugehistogram": ("_bucket", "_gsum",
                                                                        "_gcount"),
             "histogram": ("_bucket", "_sum", "_count"), "summary": ("", "_sum", "_count"),
             "info": ("_info",)}


def _exported(settings: Settings) -> set[str]:
    store = Store(settings.database_url, max_size=1)
    try:
        reg: CollectorRegistry = metrics.registry(settings, store)
        fams = list(reg.collect())
    finally:
        store.close()
    up = {s.labels["source"]: s.value for f in fams if f.name.endswith("source_up")
          for s in f.samples}
    assert up == {"postgres": 1, "kafka": 1}, up  # both sources answered: every family is in
    return {f.name + sfx for f in fams for sfx in _SUFFIXES[f.type]}


@pytest.fixture
def exported(settings: Settings) -> set[str]:
    return _exported(settings)


def test_every_dashboard_query_parses_and_names_only_exported_series(
        exported: set[str], tmp_path: Path) -> None:
    exprs = panel_exprs()
    assert len(exprs) >= 20, "the dashboard lost its panels"
    r = check_parses(exprs, tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    recorded = {r["record"] for r in alert_rules() if "record" in r}
    unknown = {where: sorted(series_names(e) - exported - PENDING - recorded)
               for where, e in exprs.items()}
    unknown = {k: v for k, v in unknown.items() if v}
    assert not unknown, f"panels naming series nobody exports: {unknown}"
    named = set().union(*(series_names(e) for e in exprs.values()))
    for needed in ("jobstream_stage_runs_total", "jobstream_consumer_group_lag_messages",
                   "jobstream_topic_produced_total", "jobstream_stage_retries_total",
                   "jobstream_provider_latency_seconds_bucket",
                   "jobstream_provider_rate_limited_total",
                   "jobstream_provider_unknown_outcomes_total",
                   "jobstream_provider_cost_usd_total"):
        assert needed in named, needed


def test_every_alert_names_only_exported_series(exported: set[str]) -> None:
    recorded = {r["record"] for r in alert_rules() if "record" in r}
    for rule in alert_rules():
        unknown = series_names(rule["expr"]) - exported - PENDING - recorded
        assert not unknown, (rule.get("alert") or rule.get("record"), unknown)


def test_a_panel_naming_a_series_nobody_exports_is_caught(exported: set[str],
                                                         tmp_path: Path) -> None:
    """The check can fail: a renamed series and a query that does not parse are reported."""
    bad = {"renamed": "rate(jobstream_stage_run_total[5m])"}
    assert series_names(bad["renamed"]) - exported == {"jobstream_stage_run_total"}
    r = check_parses({"broken": "sum by (stage (rate(jobstream_stage_runs_total[5m]))"},
                     tmp_path)
    assert r.returncode != 0


def test_the_dashboard_is_provisioned_with_its_data_source() -> None:
    from ruamel.yaml import YAML
    ds = YAML(typ="safe").load((DASHBOARDS.parent / "provisioning" / "datasources"
                                / "prometheus.yml").read_text())
    uid = ds["datasources"][0]["uid"]
    for path in DASHBOARDS.glob("*.json"):
        dash = json.loads(path.read_text())
        for p in dash["panels"]:
            if p["type"] != "row":
                assert p["datasource"]["uid"] == uid, p["title"]
    compose = YAML(typ="safe").load((DASHBOARDS.parents[2] / "docker-compose.yml").read_text())
    vols = " ".join(compose["services"]["grafana"]["volumes"])
    assert "ops/grafana/dashboards" in vols and "ops/grafana/provisioning" in vols
    prom = " ".join(compose["services"]["prometheus"]["volumes"])
    assert "ops/prometheus/alerts.yml" in prom
