"""``streams.delivery.wait_first``: the fetcher's per-message hand-off without four tasks when
the stream queue has room, and exactly faust's behaviour when it has none (wait for room, or
give up when the flow is suspended for a rebalance). Driven on a real ``mode`` service with
a real ``asyncio.Queue`` (the stream queue's role); no Kafka involved."""

from __future__ import annotations

import asyncio
from typing import Any

from mode import Service
from mode.utils.locks import Event

from streams.delivery import wait_first


class _Fetcher(Service):
    """The parts of faust's Consumer that ``wait_first`` reads: its suspend-flow event and
    the service's stopped/crashed state."""

    def __init__(self) -> None:
        super().__init__()
        self.suspend_flow = Event()


async def _deliver(queue: asyncio.Queue[int], item: int) -> str:
    await queue.put(item)  # blocks while the queue is full, like a stream's queue
    return f"put {item}"


def test_a_message_with_room_is_delivered_at_once_and_the_flow_wait_never_starts() -> None:
    async def run() -> tuple[Any, Any, int, int]:
        fetcher, queue = _Fetcher(), asyncio.Queue[int](maxsize=1)
        flow = fetcher.suspend_flow.wait()
        tasks_before = len(asyncio.all_tasks())
        got = await wait_first(fetcher, _deliver(queue, 7), flow)
        return got, flow, queue.qsize(), len(asyncio.all_tasks()) - tasks_before

    got, flow, size, new_tasks = asyncio.run(run())
    assert got.results == ["put 7"] and not got.stopped and size == 1
    assert new_tasks == 0
    assert flow.cr_frame is None  # closed without running (no "never awaited" warning)


def test_a_full_queue_waits_for_room_then_delivers() -> None:
    async def run() -> tuple[Any, list[int]]:
        fetcher, queue = _Fetcher(), asyncio.Queue[int](maxsize=1)
        queue.put_nowait(1)
        pending = asyncio.ensure_future(
            wait_first(fetcher, _deliver(queue, 2), fetcher.suspend_flow.wait()))
        await asyncio.sleep(0.05)
        assert not pending.done()  # blocked on the full queue
        first = queue.get_nowait()
        got = await asyncio.wait_for(pending, 5)
        return got, [first, queue.get_nowait()]

    got, items = asyncio.run(run())
    assert got.results == ["put 2"] and items == [1, 2]


def test_a_blocked_delivery_is_given_up_when_the_flow_is_suspended() -> None:
    async def run() -> tuple[Any, int]:
        fetcher, queue = _Fetcher(), asyncio.Queue[int](maxsize=1)
        queue.put_nowait(1)
        pending = asyncio.ensure_future(
            wait_first(fetcher, _deliver(queue, 2), fetcher.suspend_flow.wait()))
        await asyncio.sleep(0.05)
        fetcher.suspend_flow.set()  # a rebalance: faust abandons the blocked hand-off
        got = await asyncio.wait_for(pending, 5)
        queue.get_nowait()
        await asyncio.sleep(0.05)  # the abandoned put was cancelled: it never lands
        return got, queue.qsize()

    got, size = asyncio.run(run())
    assert got.done and got.results == [True] and size == 0
