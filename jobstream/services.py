"""Local services (Kafka KRaft + PostgreSQL) via ``scripts/services.sh`` and readiness checks."""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

import psycopg
from confluent_kafka.admin import AdminClient

from jobstream.settings import Settings

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "services.sh"


def run_script(action: str, settings: Settings | None = None) -> int:
    """Run ``scripts/services.sh <action>`` (up|down|status|env); returns its exit code.

    Raises ``FileNotFoundError`` when the script is not there (not a source checkout).
    """
    if not SCRIPT.exists():
        raise FileNotFoundError(f"{SCRIPT} not found: services need a source checkout")
    env = dict(os.environ)
    if settings is not None:
        env.setdefault("JOBSTREAM_DATABASE_URL", settings.database_url)
        env.setdefault("JOBSTREAM_KAFKA_BOOTSTRAP_SERVERS", settings.kafka_bootstrap_servers)
    return subprocess.call(["bash", str(SCRIPT), action], env=env)


def postgres_answers(url: str) -> bool:
    """True when Postgres at ``url`` accepts a connection within 3 s."""
    try:
        with psycopg.connect(url, connect_timeout=3) as conn:
            conn.execute("SELECT 1")
        return True
    except psycopg.Error:
        return False


def kafka_answers(bootstrap: str) -> bool:
    """True when a Kafka broker at ``bootstrap`` returns metadata within 5 s."""
    try:
        # A probe: "connection refused" is its answer, not something to log.
        md = AdminClient({"bootstrap.servers": bootstrap,
                          "logger": logging.getLogger("jobstream.services.probe")}  # type: ignore[dict-item]  # librdkafka's logger is a Logger; the stub allows scalars only
                         ).list_topics(timeout=5)
        return bool(md.brokers)
    except Exception:  # librdkafka raises KafkaException on timeout
        return False
