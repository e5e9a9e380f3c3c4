"""The per-partition completion tracker behind the stage workers' offset commits."""

from __future__ import annotations

import pytest

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


def test_messages_dropped_after_a_seek_are_not_committed_past_and_are_read_again() -> None:
    # The stall after a broker SIGKILL restart (docs/design-notes.md "Stalled between
    # stages"): job.chunks_ready[2] was sought to 0 (nothing committed), offsets 0 and 1 were
    # fetched and dropped before the llm agent took them, 2..5 reached it; the group then
    # committed 2 and 0, 1 were never read again.
    t = CompletionTracker()
    t.reset([TP])
    t.sought(TP, 0)
    epochs = {o: t.received(TP, o) for o in (2, 3)}
    assert t.take_rewind(TP) == 0 and t.take_rewind(TP) is None  # one seek back
    for o, e in epochs.items():
        t.done(TP, o, e)
    assert t.committable(TP) == 0  # not 4: offsets 0 and 1 were never taken
    e4 = t.received(TP, 4)  # still fetched before the seek back took effect
    t.done(TP, 4, e4)
    assert t.committable(TP) == 0 and t.take_rewind(TP) is None
    for o in range(0, 5):  # the re-read from 0 (2..4 are duplicates for the stage)
        t.done(TP, o, t.received(TP, o))
    assert t.committable(TP) == 5 and t.take_rewind(TP) is None


def test_a_read_that_resumes_where_it_was_sought_to_changes_nothing() -> None:
    t = CompletionTracker()
    t.sought(TP, 7)
    assert t.committable(TP) is None  # nothing received: nothing to commit
    t.done(TP, 7, t.received(TP, 7))
    assert t.take_rewind(TP) is None and t.committable(TP) == 8


def test_a_real_gap_after_the_seek_back_lets_the_commit_go_on() -> None:
    # The committed offset points at a transaction marker (no message there): the seek back
    # reads from the next message again; then the gap is real and the commit moves on.
    t = CompletionTracker()
    t.sought(TP, 10)
    t.done(TP, 11, t.received(TP, 11))
    assert t.take_rewind(TP) == 10 and t.committable(TP) == 10
    t.done(TP, 11, t.received(TP, 11))  # the re-read starts at 11 again
    t.done(TP, 12, t.received(TP, 12))
    assert t.committable(TP) == 13 and t.take_rewind(TP) is None


def test_an_offset_in_flight_too_long_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """The second stall shape (docs/design-notes.md "Stalled between stages"): an offset
    taken whose run never finishes holds the commit; the tracker says so once, with the
    offset, after ``stuck_after_s``, and again when it finishes."""
    now = [0.0]
    t = CompletionTracker(stuck_after_s=60, clock=lambda: now[0])
    e = {o: t.received(TP, o) for o in (0, 1, 2)}
    t.done(TP, 1, e[1])
    t.done(TP, 2, e[2])
    now[0] = 59.0
    with caplog.at_level("WARNING", logger="jobstream.streams"):
        assert t.committable(TP) == 0
        assert not caplog.records
        now[0] = 61.0
        assert t.committable(TP) == 0
        assert t.committable(TP) == 0
    stuck = [r.getMessage() for r in caplog.records]
    assert len(stuck) == 1 and "offset 0 of job.chunks_ready[0] has been in flight for 61 s" \
        in stuck[0], stuck
    caplog.clear()
    with caplog.at_level("WARNING", logger="jobstream.streams"):
        t.done(TP, 0, e[0])
        assert t.committable(TP) == 3
    assert ["logged as stuck, finished" in r.getMessage() for r in caplog.records] == [True]


def test_a_floor_never_received_too_long_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    t = CompletionTracker(stuck_after_s=60, clock=lambda: now[0])
    t.sought(TP, 4)
    e = t.received(TP, 6)  # 4 and 5 dropped unseen; the agent asks for one seek back
    assert t.take_rewind(TP) == 4
    t.done(TP, 6, e)
    now[0] = 100.0
    with caplog.at_level("WARNING", logger="jobstream.streams"):
        assert t.committable(TP) == 4
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "offset 4 of job.chunks_ready[0] was sought to 100 s ago" \
        in msgs[0], msgs
