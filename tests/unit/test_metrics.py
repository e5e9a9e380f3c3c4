"""The metric families built from a Postgres snapshot and Kafka lags (no services)."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from jobstream.metrics import BUCKETS_S, GroupLag, kafka_families, postgres_families

SNAP = {
    "jobs": [{"lane": "interactive", "status": "succeeded", "n": 3},
             {"lane": "interactive", "status": "failed", "n": 1},
             {"lane": "batch", "status": "running", "n": 2}],
    "stage_runs": [{"stage": "llm", "runs": 8, "retries": 2, "lease_takeovers": 1,
                    "expired_now": 1},
                   {"stage": "validate", "runs": 2, "retries": 0, "lease_takeovers": 0,
                    "expired_now": 0}],
    "provider_attempts": [
        {"outcome": "succeeded", "model_profile": "openai", "n": 5, "cost_usd": 0.25},
        {"outcome": "outcome_unknown", "model_profile": "openai", "n": 2, "cost_usd": 0.05},
        {"outcome": "started", "model_profile": "openai", "n": 1, "cost_usd": 0.0}],
    "outbox": [{"n": 4, "oldest_s": 12.5}],
    # llm/interactive: 2 values <= 0.05 s (idx 0), 1 value in (1, 2.5] (idx 5), 1 above
    # every bound (idx len(BUCKETS_S)).
    "stage_durations": [
        {"stage": "llm", "lane": "interactive", "idx": 0, "n": 2, "sum_s": 0.04},
        {"stage": "llm", "lane": "interactive", "idx": 5, "n": 1, "sum_s": 2.0},
        {"stage": "llm", "lane": "interactive", "idx": len(BUCKETS_S), "n": 1,
         "sum_s": 7200.0}],
    "queue_waits": [],
}


def _samples(families) -> dict:  # type: ignore[no-untyped-def]
    reg = CollectorRegistry()

    class C:
        def collect(self):  # type: ignore[no-untyped-def]
            return families

    reg.register(C())
    out: dict = {}
    for fam in text_string_to_metric_families(generate_latest(reg).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_postgres_families_compute_rates_costs_and_cumulative_buckets() -> None:
    m = _samples(postgres_families(SNAP))
    assert m[("jobstream_jobs_created_total", (("lane", "interactive"),))] == 4
    assert m[("jobstream_jobs_created_total", (("lane", "batch"),))] == 2
    assert m[("jobstream_jobs_accepted", (("lane", "interactive"),))] == 3
    assert m[("jobstream_jobs_accepted", (("lane", "batch"),))] == 0
    assert m[("jobstream_job_retry_rate", ())] == 0.2  # 2 retries / 10 runs
    assert m[("jobstream_lease_expired_total", (("stage", "llm"),))] == 1
    assert m[("jobstream_leases_expired", (("stage", "llm"),))] == 1
    ok = (("model_profile", "openai"), ("outcome", "succeeded"))
    assert m[("jobstream_provider_attempts_total", ok)] == 5
    assert ("jobstream_provider_attempts_total",
            (("model_profile", "openai"), ("outcome", "started"))) not in m
    assert m[("jobstream_provider_attempts_in_flight", (("model_profile", "openai"),))] == 1
    assert m[("jobstream_provider_unknown_outcomes_total", (("model_profile", "openai"),))] == 2
    assert math.isclose(m[("jobstream_cost_per_accepted_job_usd", ())], 0.1)  # 0.30 USD / 3
    assert m[("jobstream_outbox_backlog", ())] == 4
    assert m[("jobstream_outbox_oldest_age_seconds", ())] == 12.5

    def bucket(le: str) -> float:
        return m[("jobstream_stage_duration_seconds_bucket",
                  (("lane", "interactive"), ("le", le), ("stage", "llm")))]
    assert [bucket("0.05"), bucket("1.0"), bucket("2.5"), bucket("3600.0"), bucket("+Inf")] \
        == [2, 2, 3, 3, 4]
    key = (("lane", "interactive"), ("stage", "llm"))
    assert m[("jobstream_stage_duration_seconds_gcount", key)] == 4
    assert math.isclose(m[("jobstream_stage_duration_seconds_gsum", key)], 7202.04)


def test_no_accepted_job_means_no_cost_per_job_and_no_runs_means_no_retries() -> None:
    empty = {k: [] for k in SNAP}
    m = _samples(postgres_families(empty))
    assert math.isnan(m[("jobstream_cost_per_accepted_job_usd", ())])
    assert m[("jobstream_job_retry_rate", ())] == 0
    assert m[("jobstream_outbox_backlog", ())] == 0


def test_kafka_families_per_topic_and_per_group() -> None:
    m = _samples(kafka_families([GroupLag("g1", {"a": 2, "b": 3}), GroupLag("idle")]))
    assert m[("jobstream_consumer_lag_messages", (("group", "g1"), ("topic", "a")))] == 2
    assert m[("jobstream_consumer_group_lag_messages", (("group", "g1"),))] == 5
    assert ("jobstream_consumer_group_lag_messages", (("group", "idle"),)) not in m


def test_module_docstring_lists_every_exported_family() -> None:
    """The metrics table in jobstream/metrics.py names every family the collector builds (and
    nothing else): operators read it as the list of what exists."""
    import re
    from pathlib import Path

    from jobstream import metrics

    source = Path(metrics.__file__).read_text()
    built = set(re.findall(r'f"\{NS\}_([a-z_]+)"', source))
    table = {re.sub(r"_total$", "", m) for m in
             re.findall(r"^([a-z_]+)(?:\{[^}]*\})?\s+(?:counter|gauge)", metrics.__doc__ or "",
                        re.MULTILINE)}
    assert built, "no metric family found in the source"
    assert built - table == set(), "exported but not in the docstring table"
    assert table - built == set(), "in the docstring table but not exported"


def test_dead_letters_stored_per_source_and_reason() -> None:
    snap = {**SNAP, "dead_letters": [{"source": "relay", "reason_code": "undeliverable", "n": 2},
                                     {"source": "consumer", "reason_code": "message_too_large",
                                      "n": 1}]}
    m = _samples(postgres_families(snap))
    assert m[("jobstream_dead_letters_stored", (("reason_code", "undeliverable"),
                                                ("source", "relay")))] == 2
    assert m[("jobstream_dead_letters_stored", (("reason_code", "message_too_large"),
                                                ("source", "consumer")))] == 1
