"""The consumer library stands alone: nothing in consumers/ (nor the example service) imports
jobstream, it imports with jobstream made unimportable, and its registration and DDL behave as
documented (no services needed)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from psycopg import sql

from consumers import ConsumerSettings, IdempotentConsumer, ddl
from schemas.events import JobFailed, JobReady

ROOT = Path(__file__).parents[2]


def _imports(folder: Path) -> set[str]:
    names: set[str] = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
    return names


@pytest.mark.parametrize("folder", ["consumers", "examples/downstream_service"])
def test_no_jobstream_import(folder: str) -> None:
    found = {n for n in _imports(ROOT / folder) if n == "jobstream" or n.startswith("jobstream.")}
    assert not found, f"{folder} imports {found}"


def test_imports_with_jobstream_unimportable() -> None:
    code = ("import sys; sys.modules['jobstream'] = None\n"
            "import consumers, consumers.idempotent, consumers.routing, consumers.ddl\n"
            "import examples.downstream_service.service\n"
            "print('ok', [m for m in sys.modules if m.startswith(('faust', 'fastapi'))])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok []"


def test_the_event_class_chooses_topic_and_route() -> None:
    c = IdempotentConsumer(ConsumerSettings(bootstrap_servers="127.0.0.1:1", topic_prefix="t1-"))

    @c.on(JobReady)
    def apply(tx: object, event: JobReady) -> None: ...

    @c.on(JobFailed, topic="other.failed")
    def failed(tx: object, event: JobFailed) -> None: ...

    assert c.topics == ["t1-job.ready", "other.failed"]
    assert c.event_types == ("job.ready", "job.failed")
    with pytest.raises(ValueError, match="one handler per event class"):
        c.on(JobReady)
    with pytest.raises(ValueError, match="no event_type"):
        c.on(int)
    c._consumer.close()


def test_a_batch_handler_comes_after_the_per_event_handler() -> None:
    c = IdempotentConsumer(ConsumerSettings(bootstrap_servers="127.0.0.1:1"))
    with pytest.raises(ValueError, match="per-event handler"):
        c.on_batch(JobReady)

    @c.on(JobReady)
    def apply(tx: object, event: JobReady) -> None: ...

    @c.on_batch(JobReady)
    def apply_many(tx: object, events: list[JobReady]) -> None: ...

    assert c._batch_handlers == {"job.ready": apply_many}
    assert c._handlers == {"job.ready": apply}
    with pytest.raises(ValueError, match="already has a batch handler"):
        c.on_batch(JobReady)
    c._consumer.close()


def test_settings_come_from_the_consumer_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JOBSTREAM_CONSUMER_GROUP", "billing")
    monkeypatch.setenv("JOBSTREAM_CONSUMER_DB_SCHEMA", "billing")
    monkeypatch.setenv("JOBSTREAM_CONSUMER_POISON_AFTER", "3")
    s = ConsumerSettings()
    assert (s.group, s.db_schema, s.poison_after) == ("billing", "billing", 3)


def test_the_batch_byte_cap_reaches_the_library_and_consume_ready(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One variable sets the byte cap of a batch for the library and for `jobstream
    consume-ready` (whose Settings pass it on); 64 MiB by default."""
    from jobstream.ready_applier import consumer_settings
    from jobstream.settings import Settings
    assert ConsumerSettings().batch_max_bytes == 64 * 1024 * 1024
    monkeypatch.setenv("JOBSTREAM_CONSUMER_BATCH_MAX_BYTES", "300000")
    assert ConsumerSettings().batch_max_bytes == 300_000
    assert consumer_settings(Settings(), "g").batch_max_bytes == 300_000
    with pytest.raises(ValueError, match="batch_max_bytes"):  # a Bind over 1 GB is refused
        ConsumerSettings(batch_max_bytes=1024 ** 3)


def test_ddl_quotes_identifiers() -> None:
    q = ddl('we"ird', "pe")
    assert isinstance(q, sql.Composed)
    text = repr(q)
    assert "Identifier('we\"ird', 'pe')" in text
    assert "Identifier('pe_event_id')" in text
