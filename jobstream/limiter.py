"""The provider concurrency limit shared by every worker of both lanes, with AIMD.

State lives in Postgres (``provider_limit``, ``provider_slot``) so every process sees the same
limit, not a per-process semaphore. A call holds a slot while in flight; a slot expires by
itself if its holder dies. The window follows TCP congestion control (RFC 5681; Chiu & Jain
1989), with slots for segments and 429s for losses:

- **slow start**: a new profile starts at :data:`INITIAL_WINDOW` slots (RFC 5681 §3.1 IW) and
  each success adds one, doubling the window per round of calls, until the first 429 or the
  ceiling. Starting at the ceiling instead sent a burst of ``provider_max_concurrency`` calls
  at a provider that allowed fewer, and every call over its limit was one more 429;
- **multiplicative decrease, once per window**: a 429 sets window and ``ssthresh`` to half the
  calls in flight (RFC 5681 eq. 4, ``FlightSize/2``, floor 1) and remembers the last slot in
  flight (``recover_slot_id``, NewReno's "recover", RFC 6582 §3.2). A 429 on a slot taken up to
  then answers the same overload and changes nothing: TCP reduces at most once per window of
  data (RFC 3168 §6.1.2, "once per RTT"). The old rule, at most once per second, let a window
  of 0.2 s calls collect five rounds of 429s before the second halving;
- **additive increase**: above ``ssthresh``, one slot per window's worth of successes
  (``+1/window`` per success, congestion avoidance). Calls that were in flight at the latest
  decrease do not grow the window (as in NewReno's fast recovery). Plain "+1 per success" would
  climb back over the provider's threshold within a few calls and keep provoking 429s.

Interactive work is reserved ``interactive_reserved`` slots: batch work may use at most
``floor(limit) - reserved`` of them, so a person's document always finds a slot soon.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from jobstream.db import QUERIES as Q
from jobstream.errors import RetryableError
from jobstream.store import Store

#: Slots a new profile starts with (slow start; RFC 5681 §3.1 allows 2-4 segments).
INITIAL_WINDOW = 2


@dataclass(frozen=True)
class Slot:
    """A held slot of the shared limit."""

    slot_id: int
    profile: str


class SharedLimiter:
    """AIMD concurrency limit per profile, shared through Postgres.

    ``max_limit``: ceiling (calls in flight); ``reserved``: slots batch may not take;
    ``hold_s``: how long a slot lives if its holder never releases it (seconds).
    """

    def __init__(self, store: Store, *, max_limit: int, reserved: int, hold_s: float) -> None:
        self.store = store
        self.max_limit = max_limit
        self.reserved = reserved
        self.hold_s = hold_s
        self._known: set[str] = set()

    def _ensure(self, profile: str) -> None:
        if profile not in self._known:
            with self.store.tx() as conn:
                conn.execute(Q["limit_ensure"], {
                    "profile": profile, "initial": float(min(INITIAL_WINDOW, self.max_limit)),
                    "max_limit": self.max_limit, "reserved": self.reserved})
            self._known.add(profile)

    def try_acquire(self, profile: str, lane: str, job_id: uuid.UUID | None) -> Slot | None:
        """Take a slot if the window allows (one short transaction), else ``None``."""
        self._ensure(profile)
        with self.store.tx() as conn:
            lim = conn.execute(Q["limit_lock"], (profile,)).fetchone()
            assert lim is not None
            conn.execute(Q["slots_expire"], (profile,))
            active = conn.execute(Q["slots_active"], (profile,)).fetchone()
            assert active is not None
            window = max(1, int(lim["limit_now"]))
            if active["total"] >= window:
                return None
            if lane == "batch" and active["batch"] >= max(1, window - lim["interactive_reserved"]):
                return None
            row = conn.execute(Q["slot_insert"], (profile, lane, job_id, self.hold_s)).fetchone()
        assert row is not None
        return Slot(int(row["slot_id"]), profile)

    def acquire(self, profile: str, lane: str, job_id: uuid.UUID | None, *, timeout_s: float,
                on_wait: Callable[[], None] | None = None) -> Slot:
        """Wait for a slot (polling with jitter, 20-200 ms). ``on_wait`` runs between polls
        (lease renewal, cancel checks; it may raise). Raises :class:`RetryableError`
        ``provider_saturated`` after ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        delay = 0.02
        while True:
            slot = self.try_acquire(profile, lane, job_id)
            if slot is not None:
                return slot
            if time.monotonic() > deadline:
                raise RetryableError(f"no provider slot for {profile} within {timeout_s}s",
                                     code="provider_saturated")
            if on_wait is not None:
                on_wait()
            time.sleep(random.uniform(delay / 2, delay))
            delay = min(0.2, delay * 1.5)

    def release(self, slot: Slot, outcome: str) -> None:
        """Free the slot and adapt the window: ``succeeded`` -> slow start or additive
        increase, ``rate_limited`` -> multiplicative decrease (once per window of calls in
        flight), anything else -> unchanged."""
        args = {"profile": slot.profile, "slot_id": slot.slot_id}
        with self.store.tx() as conn:
            if outcome == "rate_limited":
                # Under the profile's lock, before this slot goes: the flight size counts it
                # and every slot taken so far.
                conn.execute(Q["limit_lock"], (slot.profile,))
                conn.execute(Q["limit_decrease"], args)
            conn.execute(Q["slot_release"], (slot.slot_id,))
            if outcome == "succeeded":
                conn.execute(Q["limit_increase"], args)
