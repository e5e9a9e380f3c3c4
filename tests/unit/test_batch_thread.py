"""streams.batchthread.BatchThread: the one-thread hand-off of a GroupCommit's / an
IntakeBatcher's batches (issue 12) keeps what ``run_in_executor`` on a one-thread pool gave."""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time

import pytest

from streams.batchthread import BatchThread

_VAR: contextvars.ContextVar[str] = contextvars.ContextVar("batch_thread_test", default="unset")


def test_runs_off_the_loop_one_at_a_time_in_order_and_returns_values() -> None:
    bt = BatchThread("t")
    running: list[int] = []
    overlap: list[bool] = []

    def job(i: int) -> tuple[int, str]:
        running.append(i)
        overlap.append(len(running) > 1)
        time.sleep(0.005)
        running.remove(i)
        return i, threading.current_thread().name

    async def main() -> list[tuple[int, str]]:
        return list(await asyncio.gather(*(bt.run(lambda i=i: job(i)) for i in range(20))))

    got = asyncio.run(main())
    assert [i for i, _ in got] == list(range(20))
    assert {name for _, name in got} == {"t"}  # one thread, not the loop's
    assert not any(overlap)


def test_an_exception_reaches_the_awaiting_task_and_the_thread_goes_on() -> None:
    bt = BatchThread("t")

    def boom() -> None:
        raise ValueError("bad batch")

    async def main() -> int:
        with pytest.raises(ValueError, match="bad batch"):
            await bt.run(boom)
        return await bt.run(lambda: 7)

    assert asyncio.run(main()) == 7


def test_a_cancelled_awaiter_leaves_the_running_batch_to_finish_and_the_next_runs() -> None:
    bt = BatchThread("t")
    started, release, finished = threading.Event(), threading.Event(), threading.Event()

    def slow() -> str:
        started.set()
        release.wait(5)
        finished.set()
        return "late"

    errors: list[dict[str, object]] = []

    async def main() -> str:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, c: errors.append(c))
        task = asyncio.ensure_future(bt.run(slow))
        while not started.is_set():
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        return await bt.run(lambda: "next")  # queued behind the cancelled one's batch

    assert asyncio.run(main()) == "next"
    assert finished.is_set()
    assert errors == []  # the late result was dropped, not set on the cancelled future


def test_the_thread_has_its_own_context_not_the_callers() -> None:
    bt = BatchThread("t")

    async def main() -> tuple[str, str]:
        _VAR.set("caller")
        plain = await bt.run(_VAR.get)
        copied = await bt.run(lambda: contextvars.copy_context().run(_VAR.get))
        ctx = contextvars.copy_context()
        as_to_thread = await bt.run(lambda: ctx.run(_VAR.get))
        assert copied == "unset"
        return plain, as_to_thread

    assert asyncio.run(main()) == ("unset", "caller")


def test_a_result_after_the_loop_closed_is_dropped_without_killing_the_thread() -> None:
    bt = BatchThread("t")
    release = threading.Event()

    async def first() -> None:
        asyncio.ensure_future(bt.run(lambda: release.wait(5)))
        await asyncio.sleep(0.01)  # the batch is running; this loop then closes

    asyncio.run(first())
    release.set()

    async def second() -> int:
        return await bt.run(lambda: 3)

    assert asyncio.run(second()) == 3
