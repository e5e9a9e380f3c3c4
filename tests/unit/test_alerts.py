"""The alert rules (ops/prometheus/alerts.yml): promtool parses them, its unit tests pass, every
alert has a test that fires it and a healthy case, and a runbook section with commands."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from ruamel.yaml import YAML

from tests.promql import ALERT_TESTS, ALERTS, alert_rules, promtool, series_names

RUNBOOK = Path(__file__).parents[2] / "docs" / "operations.md"


def _alerts() -> dict[str, dict]:  # type: ignore[type-arg]
    return {r["alert"]: r for r in alert_rules() if "alert" in r}


def test_promtool_checks_the_rules_and_their_unit_tests_pass() -> None:
    check = subprocess.run([promtool(), "check", "rules", str(ALERTS)], capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    run = subprocess.run([promtool(), "test", "rules", str(ALERT_TESTS)], capture_output=True,
                         text=True, timeout=120, cwd=ALERT_TESTS.parent)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS" in run.stdout


def test_promtool_fails_a_test_that_expects_a_silent_alert_to_fire(tmp_path: Path) -> None:
    """The unit tests can fail: a healthy series expected to fire is reported."""
    (tmp_path / "alerts.yml").write_text(ALERTS.read_text())
    (tmp_path / "t.yml").write_text("""
rule_files: [alerts.yml]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'jobstream_outbox_oldest_age_seconds'
        values: '0x10'
    alert_rule_test:
      - eval_time: 10m
        alertname: JobstreamOutboxStalled
        exp_alerts:
          - exp_labels: {severity: critical}
""")
    run = subprocess.run([promtool(), "test", "rules", "t.yml"], capture_output=True,
                         text=True, timeout=60, cwd=tmp_path)
    assert run.returncode != 0 and "FAILED" in run.stdout + run.stderr


def test_every_alert_fires_in_a_test_and_has_a_healthy_case() -> None:
    doc = YAML(typ="safe").load(ALERT_TESTS.read_text())
    fired: dict[str, int] = {}
    healthy: dict[str, int] = {}
    for t in doc["tests"]:
        for case in t.get("alert_rule_test", []):
            name = case["alertname"]
            exp = case.get("exp_alerts") or []
            if exp:
                fired[name] = fired.get(name, 0) + 1
            # healthy: nothing expected at all, or a series of the test that did not fire
            if not exp or len(t["input_series"]) > len(exp):
                healthy[name] = healthy.get(name, 0) + 1
    alerts = set(_alerts())
    assert alerts, "no alert in alerts.yml"
    assert alerts - set(fired) == set(), "alerts no test makes fire"
    assert alerts - set(healthy) == set(), "alerts without a healthy case"
    assert set(fired) - alerts == set(), "tests of alerts that do not exist"


def test_the_required_alerts_exist() -> None:
    exprs = " ".join(r["expr"] for r in _alerts().values())
    for series in ("jobstream_consumer_group_lag_messages", "jobstream_topic_produced_total",
                   "jobstream_outbox_oldest_age_seconds", "jobstream_leases_expired",
                   "jobstream_verify_broken", "jobstream_provider_rate_limited_total",
                   "jobstream_provider_limit_window", "jobstream_provider_unknown_outcomes_total",
                   "jobstream_provider_cost_usd_total", "jobstream_replication_slot_retained_bytes",
                   "jobstream_replication_slot_active"):
        assert series in exprs, series


def test_every_alert_has_a_runbook_section_with_commands() -> None:
    text = RUNBOOK.read_text()
    sections = dict(re.findall(r"^### (\w+)\n(.*?)(?=^##|\Z)", text, re.M | re.S))
    for name, rule in _alerts().items():
        assert name in sections, f"docs/operations.md has no section ### {name}"
        body = sections[name]
        assert "**Means**" in body and "**Shows the jobs**" in body and "**Fixes**" in body
        assert "```bash" in body, f"{name}: no command to run"
        assert rule["annotations"]["runbook_url"] == f"docs/operations.md#{name.lower()}"


def test_series_names_of_an_expression() -> None:
    assert series_names('sum by (stage) (rate(jobstream_stage_runs_total{stage!="x"}[5m]))'
                        ' / on (stage) group_left jobstream_b > bool 1e3 and c:d') \
        == {"jobstream_stage_runs_total", "jobstream_b", "c:d"}
