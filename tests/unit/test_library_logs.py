"""librdkafka's log goes through Python logging (WARNING and above, with the facility, repeats
folded), never as raw ``%3|…|FAIL|…`` lines on stderr. Real clients against a closed port."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import time
import uuid

import pytest
from confluent_kafka.admin import AdminClient

from jobstream.kafka import LibrdkafkaLogger


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens once closed


_PROBE = """
import sys
from confluent_kafka import Producer
from jobstream.kafka import producer_config
from jobstream.logs import configure
from jobstream.settings import Settings
configure("warning", "text")
conf = producer_config(Settings(kafka_bootstrap_servers=sys.argv[1]))
if sys.argv[2] == "raw":
    del conf["logger"]
p = Producer(conf)
p.produce("t", b"x")
p.flush(3)
"""


@pytest.mark.parametrize("mode", ["ours", "raw"])
def test_no_raw_librdkafka_lines_on_stderr(mode: str) -> None:
    r = subprocess.run([sys.executable, "-c", _PROBE, _closed_port(), mode],
                       capture_output=True, text=True, timeout=60)
    raw = [ln for ln in r.stderr.splitlines() if ln.startswith("%") and "|FAIL|" in ln]
    if mode == "raw":  # the control: without our logger librdkafka writes raw lines
        assert raw, r.stderr
        return
    assert not raw, r.stderr
    ours = [ln for ln in r.stderr.splitlines() if "jobstream.rdkafka" in ln]
    assert ours and all("librdkafka FAIL:" in ln for ln in ours), r.stderr
    assert len(ours) <= 2, r.stderr  # dozens of identical connect failures, folded


def test_repeats_are_folded_with_a_count_and_info_is_dropped(
        caplog: pytest.LogCaptureFixture) -> None:
    # A logger of its own: clients of earlier tests (same process) log to jobstream.rdkafka.
    name = f"test.rdkafka.{uuid.uuid4().hex}"
    logger = LibrdkafkaLogger(name=name, window_s=0.5)
    with caplog.at_level(logging.DEBUG, logger=name):
        # a real client reaches the logger (librdkafka may itself suppress identical errors,
        # so how many lines it sends is its business) ...
        admin = AdminClient({"bootstrap.servers": _closed_port(), "logger": logger})
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not caplog.records:
            admin.poll(0.2)
        # ... and the same line (numbers aside) repeated inside the window is folded
        for i in range(20):
            logger.log(logging.ERROR, "%s [%s] %s", "FAIL", "c", f"connect failed after {i}ms")
        time.sleep(0.6)
        logger.log(logging.ERROR, "%s [%s] %s", "FAIL", "c", "connect failed after 99ms")
        logger.log(logging.INFO, "%s [%s] %s", "CONFWARN", "c", "informational: dropped")
        logger.log(logging.WARNING, "%s [%s] %s", "OTHER", "c", "a different line")
    recs = [r for r in caplog.records if r.name == name]
    texts = [r.getMessage() for r in recs]
    assert all(r.levelno >= logging.WARNING for r in recs), texts
    assert any(t.startswith("librdkafka FAIL: [rdkafka#") for t in texts), texts  # the client
    assert not any("informational" in t for t in texts)
    mine = [t for t in texts if "[c]" in t]
    assert mine == ["librdkafka FAIL: [c] connect failed after 0ms",
                    mine[1],  # the count, when the window ended
                    "librdkafka FAIL: [c] connect failed after 99ms",
                    "librdkafka OTHER: [c] a different line"], mine
    assert "(repeated 19 times in" in mine[1], mine
