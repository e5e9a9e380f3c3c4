"""Shared plumbing of the benchmarks: an isolated database and topic prefix per run, the
machine's description, percentiles, JSON output and optional plots.

Every run creates its own database (``CREATE DATABASE`` + :func:`jobstream.db.migrate`) and its
own topic prefix, and drops/deletes both at the end, so benchmarks can run next to the test
suite on shared services. Run the scripts from the repository root as modules
(``python -m bench.relay``) so the checkout's code is the code measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from confluent_kafka.admin import AdminClient, NewTopic
from psycopg import sql

from jobstream.db import migrate
from jobstream.drills import procs
from jobstream.kafka import (
    all_topics,
    base_config,
    delete_topics,
    topic_max_message_bytes,
    topic_partitions,
)
from jobstream.settings import Settings

ROOT = Path(__file__).resolve().parents[1]


class _DefaultsHelp(argparse.HelpFormatter):
    """``--help`` shows each option's default unless it is None or the help text names it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.default not in (None, argparse.SUPPRESS, False)
                and "default" not in text and action.option_strings):
            text += " (default: %(default)s)"
        return text


def base_parser(doc: str | None) -> argparse.ArgumentParser:
    """Arguments every benchmark takes: services, partitions, plot file.

    ``doc`` is the benchmark module's docstring: its first paragraph (unwrapped) is the
    ``--help`` description, so a sentence is never cut at the end of the docstring's first line.
    """
    first = " ".join((doc or "").split("\n\n", 1)[0].split())
    p = argparse.ArgumentParser(
        description=first, formatter_class=_DefaultsHelp,
        epilog="Prints one JSON object on stdout (progress on stderr); bench/README.md says "
               "what each figure means.")
    p.add_argument("--database-url", default=os.environ.get(
        "JOBSTREAM_DATABASE_URL", os.environ.get("DATABASE_URL", Settings().database_url)),
        help="server to create the run's database on (default: JOBSTREAM_DATABASE_URL, "
             "DATABASE_URL, else the local services; not echoed here: it may hold a password)")
    p.add_argument("--kafka", default=os.environ.get(
        "JOBSTREAM_KAFKA_BOOTSTRAP_SERVERS",
        os.environ.get("KAFKA_BOOTSTRAP_SERVERS", Settings().kafka_bootstrap_servers)),
        help="Kafka bootstrap servers (default: JOBSTREAM_KAFKA_BOOTSTRAP_SERVERS, "
             "KAFKA_BOOTSTRAP_SERVERS, else 127.0.0.1:9092; now %(default)s)")
    p.add_argument("--partitions", type=int, default=6, help="partitions per topic")
    p.add_argument("--plot", metavar="PNG", type=_plot_path,
                   help="also write a plot (needs matplotlib: bash scripts/venv.sh --extra bench)")
    return p


def machine() -> dict[str, Any]:
    """What the figures ran on: cores, memory, load average before the run, versions."""
    mem = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            k, v = line.split(":", 1)
            if k in ("MemTotal", "MemAvailable"):
                mem[k] = f"{int(v.split()[0]) / 1024 / 1024:.1f} GiB"
    except OSError:
        pass
    try:
        free = subprocess.run(["free", "-h"], capture_output=True, text=True,
                              timeout=5).stdout.splitlines()
    except (OSError, subprocess.TimeoutExpired):
        free = []
    import confluent_kafka
    return {
        "nproc": os.cpu_count(), "loadavg_1_5_15": list(os.getloadavg()),
        "mem_total": mem.get("MemTotal"), "mem_available": mem.get("MemAvailable"),
        "free_h": free[:2], "python": platform.python_version(),
        "librdkafka": confluent_kafka.libversion()[0], "platform": platform.platform(),
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def pct(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100, nearest rank) of ``values``; None when empty."""
    if not values:
        return None
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(round(q / 100 * len(s) + 0.5)) - 1))
    return s[k]


def latency_summary(ms: Sequence[float]) -> dict[str, Any]:
    """count, p50, p90, p99, max (milliseconds, rounded to 0.1)."""
    r = {"count": len(ms)}
    for name, q in (("p50", 50), ("p90", 90), ("p99", 99), ("max", 100)):
        v = pct(ms, q)
        r[f"{name}_ms"] = None if v is None else round(v, 1)
    return r


@contextmanager
def fresh_database(server_url: str, label: str) -> Iterator[str]:
    """A new, migrated database for one run; dropped (WITH FORCE) afterwards."""
    name = f"jsbench_{label}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = psycopg.conninfo.make_conninfo(server_url, dbname=name)
    try:
        migrate(url)
        yield url
    finally:
        with psycopg.connect(server_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(name)))


def create_topics(settings: Settings, names: Sequence[str], *, partitions: int,
                  config: dict[str, str] | None = None, timeout_s: float = 30.0) -> None:
    """Create full topic ``names`` (waits until each has leaders), with ``max.message.bytes``
    as jobstream creates its topics (:func:`jobstream.kafka.topic_max_message_bytes`) unless
    ``config`` says otherwise: a topic at the broker's default (~1 MB), below the producer's
    ``message.max.bytes``, sends the relay's rows through its narrow-topic path (``_narrow``;
    ``bench.relay --topic-max-message-bytes``)."""
    admin = AdminClient(base_config(settings))
    futs = admin.create_topics(
        [NewTopic(n, num_partitions=partitions, replication_factor=1,
                  config={"max.message.bytes": str(topic_max_message_bytes(settings, n)),
                          **(config or {})}) for n in names],
        operation_timeout=timeout_s)
    for f in futs.values():
        f.result(timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        md = admin.list_topics(timeout=timeout_s).topics
        if all(n in md and md[n].error is None and md[n].partitions for n in names):
            return
        time.sleep(0.2)
    raise TimeoutError(f"topics {names} have no leaders after {timeout_s}s")


def delete_prefixed_topics(settings: Settings) -> None:
    """Delete every topic of the run's prefix (best effort; see jobstream.kafka)."""
    if settings.topic_prefix:
        delete_topics(settings)


@contextmanager
def isolated(args: argparse.Namespace, label: str, **settings_kw: Any) -> Iterator[Settings]:
    """Settings with a fresh database and a unique topic prefix (both removed afterwards)."""
    prefix = f"bench{label}{uuid.uuid4().hex[:6]}."
    with fresh_database(args.database_url, label) as url:
        s = Settings(database_url=url, kafka_bootstrap_servers=args.kafka, topic_prefix=prefix,
                     topic_partitions=args.partitions, **settings_kw)
        try:
            yield s
        finally:
            delete_prefixed_topics(s)


def ensure_all_topics(settings: Settings) -> None:
    """Every pipeline topic of the run's prefix, with LogAppendTime timestamps so messages
    carry the broker's append time (what "reached Kafka" means in these benchmarks)."""
    names = all_topics(settings)
    retry = [n for n in names if topic_partitions(settings, n) != settings.topic_partitions]
    create_topics(settings, [n for n in names if n not in retry],
                  partitions=settings.topic_partitions,
                  config={"message.timestamp.type": "LogAppendTime"})
    if retry:  # the .retry topics (jobstream.kafka.topic_partitions)
        create_topics(settings, retry, partitions=settings.retry_topic_partitions,
                      config={"message.timestamp.type": "LogAppendTime"})


def subprocess_env(settings: Settings, **extra: str) -> dict[str, str]:
    """Environment that carries ``settings`` to a ``python -m jobstream.cli`` child
    (:func:`jobstream.drills.procs.child_env`: secrets revealed, for the child only)."""
    return procs.child_env(settings, **extra)


def start_cli(settings: Settings, logdir: Path, name: str, *args: str, log_level: str = "warning",
              **extra_env: str) -> subprocess.Popen[bytes]:
    """Start ``python -m jobstream.cli <args>`` from the repository root (this checkout's
    code), logging to ``logdir/<name>.log`` (:func:`jobstream.drills.procs.spawn`)."""
    return procs.spawn(["--log-level", log_level, *args], subprocess_env(settings, **extra_env),
                       logdir / f"{name}.log", cwd=ROOT)


def stop(popens: Sequence[subprocess.Popen[bytes]], timeout_s: float = 20.0) -> None:
    """SIGTERM the given processes, SIGKILL what is left after ``timeout_s``
    (:func:`jobstream.drills.procs.stop`)."""
    procs.stop(popens, timeout_s)


def emit(result: dict[str, Any]) -> None:
    """Print the run's one JSON object to stdout."""
    json.dump(result, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
    sys.stdout.flush()


def log(msg: str) -> None:
    """Progress to stderr (stdout carries only the JSON)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _plot_path(path: str) -> str:
    """``--plot`` value: checked when the arguments are parsed, so a run without matplotlib
    is refused before it measures anything instead of losing its JSON at the end."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise argparse.ArgumentTypeError(
            "needs matplotlib: bash scripts/venv.sh --extra bench") from None
    return path


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend; SystemExit with a hint when not installed."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: bash scripts/venv.sh --extra bench") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def pyspy_record(pid: int, out: Path, *options: str, rate: int = 100
                 ) -> subprocess.Popen[bytes] | None:
    """``py-spy record`` of process ``pid`` into ``out`` (raw collapsed stacks, ``rate``
    samples per second, plus py-spy ``options`` such as ``--gil`` or ``--idle --threads``)
    until :func:`pyspy_stacks`; None when py-spy is not installed (said on stderr). py-spy's own
    stderr goes to ``out`` + ``.stderr``, printed by :func:`pyspy_stacks` when it records
    nothing."""
    try:
        with open(f"{out}.stderr", "wb") as err:
            return subprocess.Popen(["py-spy", "record", "-p", str(pid), "-r", str(rate),
                                     "--format", "raw", *options, "-o", str(out),
                                     "--nonblocking"],
                                    stdout=subprocess.DEVNULL, stderr=err)
    except FileNotFoundError:
        print("py-spy is not installed: no profile (bash scripts/venv.sh --extra bench)",
              file=sys.stderr)
        return None


def pyspy_stacks(proc: subprocess.Popen[bytes] | None, out: Path
                 ) -> list[tuple[list[str], int]] | None:
    """Stop a :func:`pyspy_record` (SIGINT: py-spy then writes its file; killed after 30 s)
    and read it: one ``(frames, samples)`` per collapsed stack, frames outermost first (the
    first is the thread with ``--threads``). None when nothing was recorded."""
    if proc is None:
        return None
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
    if not out.exists():
        err = Path(f"{out}.stderr")
        said = err.read_text(errors="replace").strip() if err.exists() else ""
        print(f"py-spy recorded nothing for {out.name} (exit {proc.returncode}): "
              f"{said[-500:] or 'no message'}", file=sys.stderr)
        return None
    stacks = []
    for line in out.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if n.isdigit():
            stacks.append((stack.split(";"), int(n)))
    return stacks
