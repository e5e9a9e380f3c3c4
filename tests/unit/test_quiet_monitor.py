"""streams.app.QuietMonitor keeps what faust itself reads of its Monitor outside the web views:
``stream_inbound_time``, read by the consumer's livelock check (faust/transport/drivers/
aiokafka.py ``verify_event_path``). Without it, a worker older than
``stream_processing_timeout`` logged ERROR "Stream has not started processing" for every
partition whose highwater was past its fetch position (breaker7)."""

from __future__ import annotations

from time import monotonic

from faust.types import TP

from streams.app import QuietMonitor


def test_the_quiet_monitor_records_when_a_stream_last_took_an_event_of_a_partition() -> None:
    monitor = QuietMonitor()
    tp = TP("t.job.extracted", 3)
    before = monotonic()
    monitor.on_stream_event_in(tp, 17, stream=None, event=None)
    assert before <= monitor.stream_inbound_time[tp] <= monotonic()
    # the per-event counters faust's web views read are still not kept
    assert monitor.events_total == 0
