"""The series the alerts and the dashboard added: 429s per profile, provider latency, the
.retry/.dlq twins' sizes (metric families from a snapshot, no services)."""

from __future__ import annotations

from jobstream.metrics import BUCKETS_S, kafka_families, postgres_families
from tests.unit.test_metrics import SNAP, _samples


def test_rate_limited_attempts_and_provider_latency() -> None:
    snap = {**SNAP, "provider_attempts": [
        {"outcome": "transient_error", "model_profile": "openai", "n": 4, "cost_usd": 0.0,
         "rate_limited": 3},
        {"outcome": "succeeded", "model_profile": "openai", "n": 5, "cost_usd": 0.25,
         "rate_limited": 0},
        {"outcome": "succeeded", "model_profile": "vllm", "n": 1, "cost_usd": 0.0,
         "rate_limited": 0}],
        "provider_latency": [
            {"model_profile": "openai", "lane": "batch", "idx": 4, "n": 2, "sum_s": 1.5},
            {"model_profile": "openai", "lane": "batch", "idx": len(BUCKETS_S), "n": 1,
             "sum_s": 4000.0}]}
    m = _samples(postgres_families(snap))
    assert m[("jobstream_provider_rate_limited_total", (("model_profile", "openai"),))] == 3
    assert m[("jobstream_provider_rate_limited_total", (("model_profile", "vllm"),))] == 0
    key = (("lane", "batch"), ("model_profile", "openai"))
    assert m[("jobstream_provider_latency_seconds_gcount", key)] == 3
    assert m[("jobstream_provider_latency_seconds_bucket",
              (("lane", "batch"), ("le", "1.0"), ("model_profile", "openai")))] == 2
    assert m[("jobstream_provider_latency_seconds_bucket",
              (("lane", "batch"), ("le", "+Inf"), ("model_profile", "openai")))] == 3


def test_retry_and_dlq_twins_written_and_held() -> None:
    m = _samples(kafka_families([], {"p.job.ready.dlq": (7, 2), "p.job.accepted.retry": (0, 0)}))
    assert m[("jobstream_topic_produced_total", (("topic", "p.job.ready.dlq"),))] == 7
    assert m[("jobstream_topic_retained_messages", (("topic", "p.job.ready.dlq"),))] == 2
    assert m[("jobstream_topic_produced_total", (("topic", "p.job.accepted.retry"),))] == 0
