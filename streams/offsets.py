"""Offsets follow completion, per partition: what the stage workers commit to Kafka.

An agent may run several events at once (the LLM agent runs ``llm_concurrency``), so events
of one partition finish out of order. The committed offset of a partition must never pass a
message that is still being processed: after a crash or a rebalance the next owner starts at
the committed offset, and a message below it would never be delivered again (issue 11,
problem 2: offset 116 still calling the provider, 117 finished, 118 committed).

faust's own ack tracking (``Consumer._new_offset``) has an off-by-one that lets the commit
pass a single unfinished message at the head (faust-streaming#606, fix proposed in #707,
unreleased), and it acks an event when the agent takes the next one rather than when the
event's work is done. So we track completion ourselves and hand faust only the result:

- :class:`CompletionTracker` records, per partition, the offsets received and not yet done;
  the committable offset is the lowest of them (everything below it is done), or one past the
  highest offset received when nothing is in flight;
- :class:`TrackedConsumerMixin` replaces faust's ``_new_offset`` with the tracker's answer, and
  resets a partition's state when it is revoked or assigned (a rebalance), so a late completion
  from a previous assignment cannot move the offset of the next one;
- :func:`rewind_to_committed` makes faust's "seek back to the committed offsets" real for every
  partition: aiokafka's ``seek_to_committed`` (what faust calls after a rebalance, and whenever
  it drops records it fetched while its flow was stopped) seeks only where the committed offset
  is above 0. A partition whose group committed nothing yet, or 0, kept the fetch position past
  the records faust had dropped, so they were never delivered again. That is how a worker
  resumed after SIGSTOP (test_pause ``sigstop``, intermittently under load) lost its
  ``job.chunks_ready`` partition: offset 0 was in flight when it froze (so 0 or nothing was
  committed), the sweeper's re-driven event landed at offset 1, both were fetched while the
  rebalance after SIGCONT had the flow stopped, dropped, and never read again: the worker
  logged nothing more for 3 minutes and the job stayed ``running``;
- a commit that failed is not taken for done: faust records the offsets it tried as committed
  whether or not the broker took them (``Consumer._commit_offsets``), and a commit sent just
  before a rebalance fails ("already rebalanced") and may return after the new assignment's
  seek. Then faust believes an offset committed that the broker never got and never sends it
  again (it only commits offsets above what it believes): the partition's lag stays for good.
  The likely cause of the one ``sigstop`` failure seen with the rewind above in place (1 run
  in 22: the job succeeded and was applied once, the run never settled);
- :func:`install` wires both into a faust app before its consumer is created.

Only messages an agent actually took count (:meth:`CompletionTracker.received`): an event
dropped at a rebalance (faust's generation check, or ours in ``streams/base.py``) is never
registered, and the rewind above re-reads it for the next owner. That alone did not keep the
commit below it: when later offsets of the partition reached the agent first, "the lowest
offset in flight" was above the dropped ones, and the group committed past them (the broker
SIGKILL stall: docs/design-notes.md "Stalled between stages"). So every seek also tells the
tracker where the partition was sought to (:meth:`CompletionTracker.sought`): the commit stays
at or below that offset until it is taken, and the first offset taken above it asks for one
seek back (:meth:`CompletionTracker.take_rewind`, done by the agent in ``streams/base.py``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import faust
from aiokafka import AIOKafkaConsumer, TopicPartition

log = logging.getLogger("jobstream.streams")


@dataclass
class _Partition:
    epoch: int = 0
    in_flight: dict[int, int] = field(default_factory=dict)  # offset -> copies in flight
    next_offset: int | None = None  # one past the highest offset received
    floor: int | None = None  # sought to, not received since: the commit never passes it
    rewind: int | None = None  # a gap seen above ``floor``: seek back here (once per floor)
    sought_back: bool = False  # the seek back for ``floor`` was asked for
    since: dict[int, float] = field(default_factory=dict)  # offset -> first received (clock)
    floor_since: float = 0.0  # when ``floor`` was set (clock)
    warned: set[int] = field(default_factory=set)  # offsets (or -1-floor) already logged


class CompletionTracker:
    """Per-partition completion of consumed messages (thread-safe).

    Keys are faust ``TP`` tuples (topic, partition); offsets are Kafka offsets (ints).

    ``stuck_after_s`` (seconds): when :meth:`committable` finds the partition's commit held
    that long by one offset still in flight, or by a seek's floor never received, it logs a
    WARNING once for it (the second stall shape in docs/design-notes.md "Stalled between
    stages": an offset taken whose run never finished, or one dropped unseen). ``clock``:
    seconds, monotonic.
    """

    def __init__(self, stuck_after_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._parts: dict[Any, _Partition] = {}
        self.stuck_after_s = stuck_after_s
        self._clock = clock

    def received(self, tp: Any, offset: int) -> int:
        """Record that ``offset`` of ``tp`` started processing; returns the assignment epoch
        to pass to :meth:`done`."""
        with self._lock:
            p = self._parts.get(tp)
            if p is None:  # not setdefault: that builds a _Partition per message (~1.6 us)
                p = self._parts[tp] = _Partition()
            if p.floor is not None:
                if offset <= p.floor:  # the read resumed where it was sought to
                    p.floor, p.sought_back = None, False
                elif not p.sought_back:  # [floor, offset) fetched but never taken: re-read
                    p.rewind, p.sought_back = p.floor, True
                elif p.next_offset is not None and offset < p.next_offset:
                    # The re-read after the seek back started above floor: a real gap.
                    log.warning("offsets %d..%d of %s[%d] are not in the log after a seek "
                                "back (transaction markers or compaction); going on",
                                p.floor, offset - 1, tp[0], tp[1])
                    p.floor, p.sought_back = None, False
            if offset not in p.in_flight:
                p.since[offset] = self._clock()
            p.in_flight[offset] = p.in_flight.get(offset, 0) + 1
            if p.next_offset is None or offset + 1 > p.next_offset:
                p.next_offset = offset + 1
            return p.epoch

    def done(self, tp: Any, offset: int, epoch: int) -> None:
        """Record that ``offset`` of ``tp`` finished (processed, dead-lettered or sent to the
        retry topic). A completion from an earlier assignment ``epoch`` is ignored."""
        with self._lock:
            p = self._parts.get(tp)
            if p is None or p.epoch != epoch or offset not in p.in_flight:
                return
            p.in_flight[offset] -= 1
            if not p.in_flight[offset]:
                del p.in_flight[offset]
                p.since.pop(offset, None)
                if offset in p.warned:
                    p.warned.discard(offset)
                    log.warning("offset %d of %s[%d], logged as stuck, finished",
                                offset, tp[0], tp[1])

    def committable(self, tp: Any) -> int | None:
        """The offset to commit for ``tp``: the lowest offset still in flight (every message
        below it is done), else one past the highest received; None before the first. Never
        above the offset ``tp`` was last sought to (:meth:`sought`) until that offset, or one
        below it, was received: messages fetched after a seek and dropped before an agent took
        them (a rebalance) must be read again, not committed past."""
        with self._lock:
            p = self._parts.get(tp)
            if p is None:
                return None
            offset = p.next_offset
            if p.in_flight:
                offset = low = min(p.in_flight)
                self._stuck(tp, p, low, p.since.get(low))
            if offset is not None and p.floor is not None:
                if p.floor < offset:
                    self._stuck(tp, p, -1 - p.floor, p.floor_since)
                return min(offset, p.floor)
            return offset

    def _stuck(self, tp: Any, p: _Partition, offset: int, since: float | None) -> None:
        """Log (once) that ``offset`` of ``tp`` has held the commit for ``stuck_after_s`` or
        longer; a negative ``offset`` is ``-1 - floor``: a seek's floor never received."""
        if since is None or offset in p.warned:
            return
        age = self._clock() - since
        if age < self.stuck_after_s:
            return
        p.warned.add(offset)
        if offset >= 0:
            log.warning("offset %d of %s[%d] has been in flight for %.0f s (%d copies): the "
                        "partition's offset commit waits for it; its run has not finished "
                        "(a stage call that never returns?). The sweeper re-drives its job "
                        "after sweep_stall_grace_s; a rebalance redelivers it",
                        offset, tp[0], tp[1], age, p.in_flight.get(offset, 0))
        else:
            log.warning("offset %d of %s[%d] was sought to %.0f s ago and never received "
                        "while later offsets were (up to %s): the commit is held there; "
                        "fetched and dropped before an agent took it?",
                        -1 - offset, tp[0], tp[1], age, p.next_offset)

    def sought(self, tp: Any, offset: int) -> None:
        """Record that the consumer's position of ``tp`` was set to ``offset`` (a seek to the
        committed offset): the next offset received should be ``offset``. One above it means
        the messages between were fetched and dropped before an agent took them; then the
        commit is held at ``offset`` and :meth:`take_rewind` asks for one seek back."""
        with self._lock:
            p = self._parts.setdefault(tp, _Partition())
            p.floor, p.rewind, p.sought_back = offset, None, False
            p.floor_since = self._clock()
            p.warned = {o for o in p.warned if o >= 0}  # an earlier floor's warning

    def take_rewind(self, tp: Any) -> int | None:
        """The offset to seek ``tp`` back to, once, if the last :meth:`received` offset left
        a gap above the position it was sought to (see :meth:`sought`); else None."""
        with self._lock:
            p = self._parts.get(tp)
            if p is None or p.rewind is None:
                return None
            offset, p.rewind = p.rewind, None
            return offset

    def in_flight(self, tp: Any) -> list[int]:
        """Offsets of ``tp`` still being processed, ascending."""
        with self._lock:
            p = self._parts.get(tp)
            return sorted(p.in_flight) if p else []

    def reset(self, tps: Iterable[Any]) -> None:
        """Forget ``tps`` (revoked or newly assigned): a new epoch, nothing in flight."""
        with self._lock:
            for tp in tps:
                old = self._parts.get(tp)
                self._parts[tp] = _Partition(epoch=(old.epoch + 1) if old else 1)


async def rewind_to_committed(consumer: AIOKafkaConsumer,
                              tracker: CompletionTracker | None = None
                              ) -> dict[TopicPartition, int | None]:
    """Seek every partition assigned to ``consumer`` to its group's committed offset, or to
    the beginning (``auto_offset_reset=earliest``) where the group committed nothing or 0.

    Returns ``{partition: committed offset or None}`` (what faust's ``perform_seek`` expects
    from ``seek_to_committed``). aiokafka's own ``seek_to_committed`` skips the seek when the
    committed offset is 0 or absent, leaving the position after records that were fetched and
    then dropped. ``tracker``: told where each partition was sought to
    (:meth:`CompletionTracker.sought`). Raises what ``AIOKafkaConsumer.committed`` raises
    (broker errors).
    """
    committed: dict[TopicPartition, int | None] = {}
    from_start = []
    for tp in consumer.assignment():
        offset = await consumer.committed(tp)
        committed[tp] = offset
        if offset is None or offset <= 0:
            from_start.append(tp)
        else:
            consumer.seek(tp, offset)
            if tracker is not None:
                tracker.sought(tp, offset)
    # An explicit offset, not seek_to_beginning(): that leaves the position unknown until the
    # fetcher resolves it, and faust's livelock check reads it meanwhile (AssertionError,
    # consumer crashed).
    if from_start:
        for tp, offset in (await consumer.beginning_offsets(from_start)).items():
            consumer.seek(tp, offset)
            if tracker is not None:
                tracker.sought(tp, offset)
    return committed


class TrackedConsumerMixin:
    """Mixed into faust's transport consumer: commits what :class:`CompletionTracker` says,
    never what faust's acks say."""

    tracker: CompletionTracker

    def _new_offset(self, tp: Any) -> int | None:
        acked = self._acked.get(tp)  # type: ignore[attr-defined]  # faust Consumer's, mixed in
        if acked:  # faust's ack bookkeeping is not used: keep it from growing
            acked.clear()
            self._acked_index[tp].clear()  # type: ignore[attr-defined]  # faust Consumer's
        return self.tracker.committable(tp)

    async def seek_to_committed(self) -> dict[TopicPartition, int | None]:
        """faust's "seek back to the committed offsets", for every partition
        (:func:`rewind_to_committed`), run in the consumer's thread."""
        thread = self._thread  # type: ignore[attr-defined]  # faust Consumer's, mixed in
        rewound: dict[TopicPartition, int | None] = await thread.call_thread(
            rewind_to_committed, thread._ensure_consumer(), self.tracker)
        return rewound

    async def _commit_offsets(self, offsets: Any, start_new_transaction: bool = True) -> bool:
        """faust's commit, except that offsets the broker did not take are not remembered as
        committed (faust would never send them again)."""
        known = self._committed_offset  # type: ignore[attr-defined]  # faust Consumer's
        before = {tp: known.get(tp) for tp in offsets}
        did_commit: bool = await super()._commit_offsets(  # type: ignore[misc]  # faust's
            offsets, start_new_transaction=start_new_transaction)
        if not did_commit:
            for tp, offset in offsets.items():
                if known.get(tp) == offset:  # still our failed attempt: forget it
                    known[tp] = before[tp]
        return did_commit

    async def on_partitions_revoked(self, revoked: set[Any]) -> None:
        await super().on_partitions_revoked(revoked)  # type: ignore[misc]  # the faust base, mixed in
        self.tracker.reset(revoked)

    async def on_partitions_assigned(self, assigned: set[Any], generation_id: int = 0) -> None:
        self.tracker.reset(assigned)
        await super().on_partitions_assigned(assigned, generation_id)  # type: ignore[misc]  # faust's


def install(app: faust.App, stuck_after_s: float = 300.0) -> CompletionTracker:
    """Make ``app``'s consumer commit by completion (call before the app starts); returns the
    tracker the agents report to (also ``app.completion_tracker``). ``stuck_after_s``: see
    :class:`CompletionTracker` (seconds)."""
    tracker = CompletionTracker(stuck_after_s)
    transport = app.transport
    base = transport.Consumer
    tracked: type = type("TrackedConsumer", (TrackedConsumerMixin, base), {"tracker": tracker})
    transport.Consumer = tracked  # type: ignore[misc]  # a ClassVar; only this app's transport
    app.completion_tracker = tracker  # type: ignore[attr-defined]  # our attribute on faust.App
    return tracker
