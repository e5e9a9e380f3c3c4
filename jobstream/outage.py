"""One log line when Kafka goes away and one when it is back, instead of one per reconnect.

During a broker outage aiokafka (the faust workers) logs an ERROR per reconnect attempt and
per request (about 2,000 lines for 17 s), and librdkafka (relay, consume-ready) one line per
connect attempt. :func:`install` puts a filter on the Kafka client loggers of this process:

- the first client record that says the broker cannot be reached becomes one WARNING line,
  ``kafka unreachable (<first error>); client errors suppressed until it answers again``;
- every client record after it is counted and dropped while the outage lasts;
- a watcher thread declares the end when a TCP connection to a bootstrap server succeeds and
  no client error came for ``quiet_s`` seconds, and logs one WARNING line,
  ``kafka reachable again after <duration>s (<n> client log lines suppressed)``.

librdkafka logs only reach Python logging when its client is given a ``logger`` (see
:data:`RDKAFKA_LOGGER`, set in :func:`jobstream.kafka.base_config`). faust's INFO lines for
every agent stopped and started on a rebalance are dropped too (they repeat on every
rebalance and say nothing an operator acts on).
"""

from __future__ import annotations

import logging
import re
import socket
import threading
import time

#: The logger librdkafka clients log through (``"logger"`` in their config).
RDKAFKA_LOGGER = "jobstream.rdkafka"
_CLIENT_PREFIXES = ("aiokafka", "kafka", RDKAFKA_LOGGER)
_UNREACHABLE = re.compile(
    r"Unable connect|Connect call failed|Unable to update metadata|NodeNotReady|"
    r"KafkaConnectionError|Connection refused|Disconnected|coordinator dead|"
    r"Coordinator Request failed|_TRANSPORT|ALL_BROKERS_DOWN|Connect to ipv|"
    r"RequestTimedOut|Failed fetch messages", re.I)
_FAUST_CHURN = re.compile(r"^\[\^-*[A-Za-z]*.*\]: (Starting|Stopping)\.\.\.\s*$")

log = logging.getLogger("jobstream.kafka")


class KafkaOutageFilter(logging.Filter):
    """Collapses a Kafka outage's client log lines into a start and an end line (see the
    module docstring). ``bootstrap``: the ``host:port,...`` list probed for the end."""

    def __init__(self, bootstrap: str, quiet_s: float = 3.0) -> None:
        super().__init__()
        self.servers = [h.strip().rsplit(":", 1) for h in bootstrap.split(",") if h.strip()]
        self.quiet_s = quiet_s
        self._lock = threading.Lock()
        self.since: float | None = None
        self.last_error = 0.0
        self.suppressed = 0

    @staticmethod
    def _client(record: logging.LogRecord) -> bool:
        if record.name.startswith(_CLIENT_PREFIXES):
            return True
        return record.name == "jobstream.consumer" and str(record.msg).startswith(
            "consumer error")

    def filter(self, record: logging.LogRecord) -> bool:
        """False for a record to drop; the outage's first record is rewritten in place."""
        if record.name.startswith("faust") or record.name.startswith("mode"):
            churn = record.levelno <= logging.INFO and _FAUST_CHURN.match(record.getMessage())
            return not churn
        if not self._client(record):
            return True
        with self._lock:
            if self.since is not None:
                self.suppressed += 1
                self.last_error = time.monotonic()
                return False
            text = record.getMessage()
            if not _UNREACHABLE.search(text):
                return True
            self.since = self.last_error = time.monotonic()
            self.suppressed = 0
        threading.Thread(target=self._watch, name="kafka-outage-watch", daemon=True).start()
        record.msg, record.args = ("kafka unreachable (%s); client errors suppressed until it "
                                   "answers again", (text[:300],))
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info = record.exc_text = None
        return True

    def _reachable(self) -> bool:
        for host, port in self.servers:
            try:
                with socket.create_connection((host, int(port)), timeout=1.0):
                    return True
            except (OSError, ValueError):
                continue
        return False

    def _watch(self) -> None:
        while True:
            time.sleep(1.0)
            with self._lock:
                quiet = time.monotonic() - self.last_error >= self.quiet_s
            if not (quiet and self._reachable()):
                continue
            with self._lock:
                took = time.monotonic() - (self.since or time.monotonic())
                n, self.since = self.suppressed, None
            log.warning("kafka reachable again after %.1fs (%d client log lines suppressed)",
                        max(0.0, took - self.quiet_s), n)
            return


_installed: KafkaOutageFilter | None = None


def install(bootstrap: str) -> KafkaOutageFilter:
    """Attach one :class:`KafkaOutageFilter` to the Kafka client loggers (aiokafka's,
    librdkafka's, the idempotent consumer's) and faust's/mode's, idempotently; call it after
    the clients' modules are imported (the loggers of modules imported later are not
    covered). Logger-level filters survive faust replacing the root handlers."""
    global _installed
    if _installed is None:
        _installed = KafkaOutageFilter(bootstrap)
    names = {RDKAFKA_LOGGER, "jobstream.consumer", "aiokafka", "kafka"}
    names |= {n for n in logging.root.manager.loggerDict
              if n.startswith(("aiokafka", "kafka", "faust", "mode"))}
    for name in names:
        logger = logging.getLogger(name)
        if _installed not in logger.filters:
            logger.addFilter(_installed)
    return _installed
