"""Retention horizons (no services)."""

from __future__ import annotations

import math

from jobstream.retention import required_processed_horizon_s


def test_processed_event_horizon_covers_two_topic_stays_a_retry_and_a_dlq() -> None:
    day = 24 * 3600 * 1000.0
    assert required_processed_horizon_s({}) == 0
    week = {"job.ready": 7 * day, "job.ready.dlq": 7 * day, "job.accepted": 7 * day,
            "job.accepted.retry": 7 * day, "job.accepted.dlq": 7 * day}
    assert required_processed_horizon_s(week) == 28 * 24 * 3600  # 2 x 7 + 7 + 7 days
    assert required_processed_horizon_s({**week, "job.ready.dlq": 30 * day}) == 44 * 24 * 3600
    assert required_processed_horizon_s({"job.ready": math.inf}) == math.inf
