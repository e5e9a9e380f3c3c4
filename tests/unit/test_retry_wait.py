"""robust11: how long the retry agent waits for a ``.retry`` message (``retry_wait_s``).

The wait ends at the ``retry_not_before_ms`` header, bounded by the message's Kafka timestamp
plus ``retry_cap_s`` (and by the cap from now): forged far-future headers on messages written
together hold the retry lane one cap in all, not one cap each.
"""

from __future__ import annotations

import pytest

from streams.base import retry_wait_s

NOW, CAP = 1_000_000.0, 300.0


@pytest.mark.parametrize(("header", "timestamp", "want"), [
    (None, NOW, 0.0),  # no header: now
    ("", NOW, 0.0),
    (str(int((NOW + 12.5) * 1000)), NOW - 1, 12.5),  # a real retry: its header's time
    (str(int((NOW - 5) * 1000)), NOW - 10, 0.0),  # due already
    ("-7", NOW, 0.0),
    (str(int((NOW + 9e9) * 1000)), NOW, CAP),  # far future, written now: one cap
    (str(int((NOW + 9e9) * 1000)), NOW - 250, 50.0),  # written 250 s ago: what is left
    (str(int((NOW + 9e9) * 1000)), NOW - 400, 0.0),  # written a cap ago: now
    (str(int((NOW + 9e9) * 1000)), NOW + 3600, CAP),  # a CreateTime in the future: now's cap
    (str(int((NOW + 9e9) * 1000)), None, CAP),  # no timestamp: the cap from now
    (str(int((NOW + 9e9) * 1000)), -1.0, CAP),  # Kafka's "no timestamp"
    ("9" * 400, NOW, 0.0),  # too large for a float
    ("1e12", NOW, 0.0),  # not an integer
    ("12abc", NOW, 0.0),
])
def test_retry_wait(header: str | None, timestamp: float | None, want: float) -> None:
    assert retry_wait_s(header, timestamp, NOW, CAP) == pytest.approx(want, abs=1e-3)
