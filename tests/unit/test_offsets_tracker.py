"""The per-partition completion tracker behind the stage workers' offset commits."""

from __future__ import annotations

from streams.offsets import CompletionTracker

TP = ("job.chunks_ready", 0)
OTHER = ("job.chunks_ready", 1)


def test_commit_never_passes_an_unfinished_message() -> None:
    t = CompletionTracker()
    assert t.committable(TP) is None
    e = {o: t.received(TP, o) for o in (116, 117, 118)}
    t.done(TP, 117, e[117])  # the head (116) is still calling the provider
    t.done(TP, 118, e[118])
    assert t.committable(TP) == 116  # faust-streaming#606 would commit 119 (or 118)
    t.done(TP, 116, e[116])
    assert t.committable(TP) == 119
    assert t.committable(OTHER) is None


def test_a_rebalance_starts_a_new_epoch_and_ignores_late_completions() -> None:
    t = CompletionTracker()
    old = t.received(TP, 10)
    t.reset([TP])  # revoked, then assigned again: the new owner restarts from the commit
    new = t.received(TP, 10)  # redelivered
    t.received(TP, 11)
    t.done(TP, 10, old)  # the run of the previous assignment finishes late: ignored
    assert t.committable(TP) == 10
    t.done(TP, 10, new)
    assert t.committable(TP) == 11
    assert t.in_flight(TP) == [11]


def test_duplicate_copies_of_one_offset_are_counted() -> None:
    t = CompletionTracker()
    a, b = t.received(TP, 5), t.received(TP, 5)
    t.done(TP, 5, a)
    assert t.committable(TP) == 5
    t.done(TP, 5, b)
    assert t.committable(TP) == 6


def test_an_event_dropped_before_it_was_taken_never_counts() -> None:
    # Offset 1 was fetched and dropped at a rebalance (never received): the commit stays
    # below it, whatever finished before, so the next owner reads it again.
    t = CompletionTracker()
    epoch = t.received(TP, 0)
    t.done(TP, 1, epoch)  # a completion of an offset never received: ignored
    assert t.committable(TP) == 0
    t.done(TP, 0, epoch)
    assert t.committable(TP) == 1
