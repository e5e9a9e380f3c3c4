"""A cheaper hand-off of each fetched message to its stream (faust's consumer; issue 12).

faust's fetcher loop (``Consumer._drain_messages``) hands every message to its stream with
``await self.wait_first(callback(message), self.suspend_flow.wait())``: four asyncio tasks
(the callback, the suspend-flow wait, the service's stopped and crashed waits) and an
``asyncio.wait`` per message, so that a callback blocked on a full stream queue is abandoned
when the flow is suspended (a rebalance). On a stage worker that was ~6 % of its CPU
(bench/results/pipeline-worker3-profile.md), while the callback almost never blocks: it puts
the message on a stream queue that has room.

:func:`install` gives faust's consumer a ``wait_first`` with a fast path for that call: when
the flow is not suspended and the service is neither stopping nor crashed, the callback's
first step runs at once; if it finishes there (the queue had room), that is the result and the
suspend-flow wait is closed unstarted. If it blocks (a full queue), the rest of it becomes a
task and faust's own ``wait_first`` waits for it or for the flow's suspension, exactly as
before. Any other call goes to faust's ``wait_first`` unchanged. Offsets are unaffected: they
follow completion (``streams/offsets.py``), not delivery.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Generator
from typing import Any

from faust.transport.consumer import Consumer
from mode.services import Service, WaitResults

_ORIGINAL = Service.wait_first


class _Resumed:
    """Awaitable that drives a coroutine already advanced one step (``coro.send(None)``
    returned ``yielded``, the future it waits on) to its end, passing what the awaiting task
    sends or throws on to it; its value is the coroutine's."""

    def __init__(self, coro: Coroutine[Any, Any, Any], yielded: Any) -> None:
        self.coro, self.yielded = coro, yielded

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, yielded = self.coro, self.yielded
        while True:
            try:
                sent = yield yielded
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # noqa: BLE001 - thrown into the coroutine (cancel)
                try:
                    yielded = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    yielded = coro.send(sent)
                except StopIteration as stop:
                    return stop.value


async def _finish(coro: Coroutine[Any, Any, Any], yielded: Any) -> Any:
    return await _Resumed(coro, yielded)


async def wait_first(self: Consumer, *coros: Any, timeout: Any = None) -> WaitResults:
    """faust's ``Service.wait_first`` with a fast path for the fetcher's per-message call
    ``wait_first(callback(message), suspend_flow.wait())`` (see the module docstring). Returns
    ``WaitResults`` like it; raises what the callback raises."""
    if (len(coros) == 2 and timeout is None and asyncio.iscoroutine(coros[0])
            and asyncio.iscoroutine(coros[1]) and not self.suspend_flow.is_set()
            and not self._stopped.is_set() and not self._crashed.is_set()):
        first, flow = coros
        try:
            yielded = first.send(None)
        except StopIteration as stop:  # delivered without waiting: the common case
            flow.close()
            return WaitResults([first], [stop.value], False)
        except BaseException:
            flow.close()
            raise
        # It waits (a full stream queue): the rest of it as a task, raced against the flow's
        # suspension by faust's own wait_first, as before.
        return await _ORIGINAL(self, asyncio.ensure_future(_finish(first, yielded)), flow)
    return await _ORIGINAL(self, *coros, timeout=timeout)


def install() -> None:
    """Give faust's ``Consumer`` :func:`wait_first`. Idempotent; call before the worker
    starts consuming (``streams.app.create_app`` does)."""
    Consumer.wait_first = wait_first  # type: ignore[method-assign,assignment]  # patched on purpose
