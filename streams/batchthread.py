"""One thread per agent for its batches: the hand-off of a shared stage transaction (issue 12).

A :class:`streams.runner.GroupCommit` and the intake's :class:`streams.intake.IntakeBatcher`
run their batches one at a time off the event loop (psycopg blocks). ``asyncio.to_thread`` /
``loop.run_in_executor`` cost ~31 us of CPU per call (a copied context, a work item, the
executor's locks and idle-thread semaphore, a ``concurrent.futures.Future`` chained to an
asyncio one by two callbacks; bench/README.md "Stage workers, perf-worker8").
:class:`BatchThread` is the same hand-off with one long-lived thread, a queue and one
``call_soon_threadsafe`` per batch (~14 us).

Semantics kept from ``loop.run_in_executor`` on a one-thread pool: batches run one at a time,
in the order handed over, in the thread's own ``contextvars`` context (a caller that wants
``asyncio.to_thread``'s copy of its own passes ``contextvars.copy_context().run``); the
awaiting task gets the function's value or its exception; cancelling the awaiting task does
not stop a batch already running (it finishes and its result is dropped, as with an
executor). The thread, once started, lives as long as the process (one per agent, as the
intake batcher's one-thread pool did); it is a daemon: a process that exits
while a batch runs does not wait for it (its transaction is rolled back when the connection
closes, its events are redelivered: the same as a kill, which every stage run already
survives).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_Job = tuple[Callable[[], Any], asyncio.AbstractEventLoop, "asyncio.Future[Any]"]


def _settle(fut: asyncio.Future[Any], ok: bool, value: Any) -> None:
    """Give ``fut`` the batch's value (``ok``) or exception, unless its awaiter left."""
    if fut.done():  # cancelled meanwhile (stopping): the result is dropped
        return
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)


class BatchThread:
    """Runs functions handed over by :meth:`run` on one thread of its own, one at a time
    (started on first use, named ``name``)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    async def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the thread; its value, or the exception it raised (an ``Exception``;
        a ``BaseException`` such as ``SystemExit`` in ``fn`` is passed on the same way)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self._start()
        self._jobs.put((fn, loop, fut))
        return await fut

    def _start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        while True:
            fn, loop, fut = self._jobs.get()
            try:
                value, ok = fn(), True
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
                value, ok = exc, False
            # RuntimeError: the loop closed meanwhile (stopping): nobody awaits the result
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle, fut, ok, value)
            del fn, loop, fut, value  # no reference to the last batch while idle
