"""``jobstream chaos``: the crash matrix (kill) and the pause matrix. Kill — or freeze past its
lease — a process at a fault point, restart (or resume) it, check.

For each fault point (``jobstream.faults``) one run, isolated by its own topic prefix and tenant:

1. start the fake provider (a real HTTP server on loopback) and point the ``custom`` model profile
   at it; start the relay, the stage workers and the downstream applier, the fault armed
   (``JOBSTREAM_FAULT``) in the process the point belongs to;
2. submit N distinct small documents of several chunks each;
3. wait until the armed process died by SIGKILL (return code -9) and restart it without the
   fault;
4. wait until the pipeline is quiescent (every job terminal, outbox drained, every consumer group
   committed up to the end of its topics), then check the invariants (:func:`check_invariants`)
   from Postgres, the topics and the fake provider's per-Idempotency-Key counters.

Pause mode (``mode="pause"``, ``jobstream chaos --mode pause``): the armed process freezes
itself at the point (SIGSTOP, ``<point>=stop``), stays frozen for ``pause_s`` seconds (longer
than the lease plus the sweeper's grace, and the Kafka session), then gets SIGCONT: a GC pause,
a stalled VM. A second worker runs beside the armed one and the sweeper is active with a short
grace, so the frozen run is fenced by a takeover or by a re-drive, whichever comes first; the
resumed process must discard its stale work. A frozen worker gets SIGCONT as soon as the run is
quiescent (every job terminal and applied, every offset committed: the second worker can only
get there once the frozen member was evicted from the group and each of its runs fenced),
``pause_s`` at most: frozen longer, it would resume into the same state. Invariants as in kill
mode, re-driven stages allowed.

The tests ``tests/e2e/test_crash_matrix.py`` and ``tests/e2e/test_pause.py`` run
:func:`run_point` per point on the test's database; the command runs :func:`run_matrix`,
which makes a scratch database per point.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from jobstream.db import QUERIES as Q
from jobstream.db import connect, migrate
from jobstream.drills.fake_provider import FakeProvider
from jobstream.drills.procs import Proc, ProcessRunner, child_env
from jobstream.kafka import delete_topics, ensure_topics, group_lag, read_to_end
from jobstream.producer import submit, uploaded_event
from jobstream.settings import Settings
from jobstream.store import TERMINAL
from schemas.pipeline import PIPELINE

#: The process each fault point belongs to (the CLI subcommand that runs it).
OWNER = {
    "llm_chunk_answered_before_save": "worker",
    "llm_after_provider_before_checkpoint": "worker",
    "stage_inside_one_transaction": "worker",
    "stage_after_commit_before_offset": "worker",
    "outbox_after_commit_before_wake": "worker",
    "relay_after_produce_before_mark": "relay",
    "consumer_after_apply_before_offset": "consume-ready",
    "consumer_inside_transaction": "consume-ready",
}
#: The matrix: each point, fired on a hit that falls in the middle of a 5-job batch.
DEFAULT_PLAN = (
    "llm_chunk_answered_before_save@3",
    "llm_after_provider_before_checkpoint@2",
    "stage_after_commit_before_offset@12",
    "relay_after_produce_before_mark@2",
    "relay_after_produce_before_mark:job.ready@2",
    "consumer_after_apply_before_offset@2",
)
#: The pause matrix: each point frozen (SIGSTOP) on an early hit, so one worker reaches it.
PAUSE_PLAN = (
    "llm_chunk_answered_before_save@2=stop",
    "llm_after_provider_before_checkpoint@1=stop",
    "stage_after_commit_before_offset@6=stop",
    "relay_after_produce_before_mark@2=stop",
    "relay_after_produce_before_mark:job.ready@1=stop",
    "consumer_after_apply_before_offset@1=stop",
)
#: The events every successful job produces, in flow order (one outbox row each).
JOB_EVENTS = tuple(s.emits for s in PIPELINE.stages)
WORKER_TOPICS = tuple(s.consumes for s in PIPELINE.stages)
STAGES = PIPELINE.names
DOWNSTREAM_GROUP = "downstream-ready-applier"
#: Provider outcomes that may precede a chunk's one success: the attempt failed or its outcome
#: is unknown (``abandoned``: its run died or was fenced mid-call), or a fenced run's answer was
#: ``discarded``. ``started`` at the end is an orphan: always a violation.
FAILED_OUTCOMES = ("transient_error", "permanent_error", "outcome_unknown", "cancelled",
                   "discarded", "abandoned")
#: The two matrices: SIGKILL at the point (then restart), or SIGSTOP there (then SIGCONT).
MODES = ("kill", "pause")

_WORDS = ("ledger archive parcel harbour signal lantern meadow quarry ribbon saddle timber "
          "vessel anchor beacon canyon delta ember falcon glacier hollow island jasper kettle "
          "lagoon marble nectar orchard pebble quartz raven summit tundra umber valley willow "
          "yonder zephyr copper ferry garnet hazel indigo juniper kelp linen mosaic").split()


def owner_of(fault: str) -> str:
    """The process (``worker``, ``relay``, ``consume-ready``) a fault spec belongs to.

    ``fault`` is ``<point>[:<event_type>][@N][=kill|=stop]``. Raises ``KeyError`` for an
    unknown point.
    """
    name = fault.split("=", 1)[0].split("@", 1)[0].split(":", 1)[0]
    if name not in OWNER:
        raise KeyError(f"unknown fault point {name!r}; known: {sorted(OWNER)}")
    return OWNER[name]


def chaos_settings(base: Settings, provider_url: str, *, lease_s: float = 5.0,
                   chunk_size_chars: int = 400) -> Settings:
    """``base`` with what the matrix needs: jobs on the ``custom`` profile served by the fake
    provider at ``provider_url``, small chunks (several per document) and a short lease, so a
    restarted worker takes over a killed run's stage within seconds."""
    return base.model_copy(update={
        "model_profile": "custom", "provider_base_url": provider_url, "lease_s": lease_s,
        "chunk_size_chars": chunk_size_chars, "fault": None})


def settings_env(settings: Settings, **extra: str) -> dict[str, str]:
    """The environment that gives a child process exactly ``settings`` (every field as
    ``JOBSTREAM_<FIELD>``), without whatever JOBSTREAM_* variables this process inherited."""
    env = child_env(settings)  # secrets (the database URL) revealed, for the child only
    env.pop("JOBSTREAM_FAULT", None)
    env.update(extra)
    return env


def make_documents(folder: Path, run_id: str, n: int, paragraphs: int = 5) -> list[Path]:
    """``n`` distinct plain-text documents of ``paragraphs`` paragraphs (~300 characters each,
    so a few chunks at 400 characters), deterministic for a given ``run_id``."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(n):
        rng = random.Random(f"{run_id}:{i}")
        paras = []
        for _ in range(paragraphs):
            sentences: list[str] = []
            while sum(len(s) + 1 for s in sentences) < 300:
                words = rng.choices(_WORDS, k=rng.randint(7, 12))
                sentences.append(" ".join(words).capitalize() + ".")
            paras.append(" ".join(sentences))
        path = folder / f"doc-{i}.txt"
        path.write_text(f"Chaos document {i} of run {run_id}\n\n" + "\n\n".join(paras) + "\n")
        out.append(path)
    return out


@dataclass
class PointResult:
    """The outcome of one fault point: what was killed, what the run saw, what went wrong."""

    fault: str
    owner: str
    jobs: int
    killed_rc: int | None = None
    mode: str = "kill"
    paused: bool = False
    frozen_s: float = 0.0
    seconds: float = 0.0
    violations: list[str] = field(default_factory=list)
    effects: dict[str, int] = field(default_factory=dict)
    logdir: Path | None = None
    log_tails: str = ""

    @property
    def ok(self) -> bool:
        """True when the point fired (SIGKILL, or SIGSTOP in pause mode) and no invariant was
        violated."""
        fired = self.paused if self.mode == "pause" else self.killed_rc == -9
        return fired and not self.violations

    def report(self, *, tails: bool = False) -> str:
        """A few lines for humans; with ``tails`` (assertion messages) the end of every
        process log of a failed run too."""
        how = (f"paused={self.paused} frozen {self.frozen_s:.1f}s" if self.mode == "pause"
               else f"killed rc={self.killed_rc}")
        head = (f"{self.fault} ({self.owner}, {self.mode}): {'PASS' if self.ok else 'FAIL'} in "
                f"{self.seconds:.0f}s, {how}, effects={self.effects}")
        return "\n".join([head, *(f"  - {v}" for v in self.violations),
                          *([f"  logs: {self.logdir}"] if self.logdir else []),
                          *([self.log_tails] if tails and self.log_tails else [])])


# ------------------------------------------------------------------------------ invariants

def check_invariants(settings: Settings, *, tenant: str, keys: list[str],
                     calls_by_key: dict[str, int], worker_killed: bool,
                     redrives: bool = False) -> tuple[list[str], dict[str, int]]:
    """Check the exactly-once invariants of a finished run; returns ``(violations, effects)``.

    - every submitted intent has a job in exactly one terminal state (succeeded: the fake
      provider answers normally), every stage succeeded, nothing running or unpublished;
    - per job and event type exactly one outbox row, and exactly that event id on the topic
      (re-publication repeats the id; a second id means a stage produced two results); the
      idempotent-consumer row of every stage recorded that event;
    - downstream applied every dedup_key exactly once (analysis and ledger rows counted);
    - per (job, chunk) exactly one ``succeeded`` provider attempt, the one whose output the
      chunk holds; any other attempt failed, or is ``abandoned`` (a killed or fenced run's,
      closed by the run that took its stage over, a re-drive or the sweeper); none is left
      ``started``; the fake provider's count for the Idempotency-Key
      ``<job_id>:<chunk_idx>`` agrees with the attempt rows: at most one call per row (every
      request is logged before it is sent) and at least one per finished row (an
      ``abandoned`` row of a killed run may or may not have been sent: a kill can land
      between the two);
    - a finished stage is never run again: no stage was claimed twice unless the worker was
      killed or paused (then at most twice; three times with ``redrives``), and no provider
      attempt started after ``llm`` finished;
    - no orphan attempt: nothing is left ``started`` (a dead or fenced run's attempt is closed
      ``abandoned``);
    - with ``redrives`` (a frozen run may have been re-driven by the sweeper): an event may
      have several outbox rows if each is of another generation (the re-driven input event),
      the idempotent-consumer row recording one of them; job.ready still exactly one.

    ``effects`` counts what the fault caused: re-published events, retaken stages, attempts
    left ``started``, provider calls.
    """
    v: list[str] = []
    with connect(settings.database_url, autocommit=True) as conn:
        def rows(name: str) -> list[dict[str, Any]]:
            return conn.execute(Q[name], (tenant,)).fetchall()
        jobs, stages, chunks = rows("inv_jobs"), rows("inv_stages"), rows("inv_chunks")
        attempts, processed = rows("inv_attempts"), rows("inv_processed")
        outbox = conn.execute(Q["inv_outbox"], {"tenant": tenant}).fetchall()
        analyses = {r["dedup_key"]: r["n"] for r in rows("inv_analyses")}
        charges = {r["dedup_key"]: r["n"] for r in rows("inv_charges")}
    effects: Counter[str] = Counter()

    # 1. one job per intent, exactly one terminal state, nothing stuck.
    by_key = {j["idempotency_key"]: j for j in jobs}
    for k in keys:
        if k not in by_key:
            v.append(f"intent {k}: no job")
    job_ids = {str(j["job_id"]): j for j in jobs}
    if len(job_ids) != len(keys):
        v.append(f"{len(keys)} distinct documents gave {len(job_ids)} jobs")
    for jid, j in job_ids.items():
        if j["status"] not in TERMINAL:
            v.append(f"job {jid}: stuck in {j['status']} at {j['current_stage']}")
        elif j["status"] != "succeeded":
            v.append(f"job {jid}: {j['status']} ({j['error_code']})")
    stage_of: dict[tuple[str, str], dict[str, Any]] = {
        (str(s["job_id"]), s["stage"]): s for s in stages}
    # A killed or paused worker's stage is claimed again once. In pause mode a third claim is
    # legitimate: the frozen process may hold a row lock (a transaction open when it froze)
    # that stalls the run taking over past its own lease, and the sweeper re-drives that run.
    max_attempt = (3 if redrives else 2) if worker_killed else 1
    for jid in job_ids:
        for st in STAGES:
            s = stage_of.get((jid, st))
            if s is None:
                v.append(f"job {jid}: no {st} checkpoint")
                continue
            if s["status"] != "succeeded":
                v.append(f"job {jid}: stage {st} is {s['status']}")
            if s["attempt"] > 1:
                effects["retaken_stages"] += 1
            if s["attempt"] > max_attempt:
                v.append(f"job {jid}: stage {st} was claimed {s['attempt']} times")

    # 2. one result per stage: one outbox row per (job, event type), that id on the topic.
    # (A published row is deleted by the relay, its outbox_published record kept: migration
    # 0022. That record has no payload: the generation is the event's, read on the topic.)
    topics = [settings.topic(t) for t in (*JOB_EVENTS, "job.failed")]
    on_topic: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    generation_of: dict[str, int] = {}
    for m in read_to_end(settings, topics):
        ev = json.loads(m.value() or b"{}")
        if ev.get("tenant_id") == tenant:
            on_topic[(ev["job_id"], ev["event_type"])][ev["event_id"]] += 1
            generation_of[str(ev["event_id"])] = int(ev.get("generation") or 0)
    outbox_ids: dict[tuple[str, str], list[str]] = defaultdict(list)
    for o in outbox:
        outbox_ids[(o["kafka_key"], o["event_type"])].append(str(o["event_id"]))
        if not o["published"]:
            v.append(f"outbox row {o['id']} ({o['event_type']}) never published")
    gens: dict[tuple[str, str], list[int]] = defaultdict(list)
    for o in outbox:
        gen = o["generation"] if o["generation"] is not None else generation_of.get(
            str(o["event_id"]), -1)  # -1: published, yet not on the topic (reported below)
        gens[(str(o["kafka_key"]), o["event_type"])].append(gen)
    # A re-drive writes a stage's input event again, one generation up: one row per generation.
    redriven = {k for k, g in gens.items() if redrives and len(g) > 1
                and len(set(g)) == len(g) and k[1] != "job.ready"}
    for jid in job_ids:
        for et in JOB_EVENTS:
            n = len(outbox_ids.get((jid, et), []))
            if (jid, et) in redriven:
                effects["redriven"] += n - 1
            elif n != 1:
                v.append(f"job {jid}: {n} {et} outbox rows (one result per stage expected)")
        if outbox_ids.get((jid, "job.failed")):
            v.append(f"job {jid}: job.failed in the outbox")
    for jid in job_ids:
        terminal = set(on_topic[(jid, "job.ready")]) | set(on_topic[(jid, "job.failed")])
        if len(terminal) != 1:
            v.append(f"job {jid}: {len(terminal)} distinct terminal events on the topics "
                     f"{sorted(terminal)}")
        for et in JOB_EVENTS:
            ids = on_topic[(jid, et)]
            if set(ids) != set(outbox_ids.get((jid, et), [])):
                v.append(f"job {jid}: {et} event ids on the topic {dict(ids)} differ from the "
                         f"outbox {outbox_ids.get((jid, et))}")
            effects["republished"] += sum(ids.values()) - len(ids)
    done = {(str(p["job_id"]), p["consumer_group"], p["event_type"]): str(p["event_id"])
            for p in processed}
    groups = {settings.group(f"jobstream-{s.name}"): s.consumes for s in PIPELINE.job_stages}
    groups[settings.group(DOWNSTREAM_GROUP)] = "job.ready"
    for jid in job_ids:
        for group, et in groups.items():
            got = done.get((jid, group, et))
            if (jid, et) in redriven and got in outbox_ids.get((jid, et), []):
                continue
            if got is None or [got] != outbox_ids.get((jid, et)):
                v.append(f"job {jid}: {group} recorded {et} as {got}, the outbox has "
                         f"{outbox_ids.get((jid, et))}")

    # 3. downstream applied each dedup_key exactly once.
    for jid, j in job_ids.items():
        dk = j["dedup_key"]
        if analyses.get(dk, 0) != 1 or charges.get(dk, 0) != 1:
            v.append(f"job {jid}: applied {analyses.get(dk, 0)}x, charged "
                     f"{charges.get(dk, 0)}x downstream (exactly once expected)")
    for dk in set(analyses) | set(charges):
        if dk not in {j["dedup_key"] for j in jobs}:
            v.append(f"downstream rows for unknown dedup_key {dk[:12]}")

    # 4. provider attempts: one success per chunk, its output kept; counts agree.
    per_chunk: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for a in attempts:
        per_chunk[(str(a["job_id"]), a["chunk_idx"])].append(a)
    chunk_keys = {(str(c["job_id"]), c["idx"]): c for c in chunks}
    for ck in set(per_chunk) - set(chunk_keys):
        v.append(f"provider attempts for a chunk that does not exist: {ck}")
    for (jid, idx), c in sorted(chunk_keys.items()):
        tries = per_chunk.get((jid, idx), [])
        final = stage_of.get((jid, "llm"), {}).get("run_token")
        ok = [a for a in tries if a["outcome"] == "succeeded"]
        where = f"job {jid} chunk {idx}"
        if len(ok) != 1:
            v.append(f"{where}: {len(ok)} succeeded provider attempts "
                     f"{[(a['attempt_id'], str(a['run_token'])[:8]) for a in ok]}")
        elif c["llm_attempt_id"] != ok[0]["attempt_id"]:
            v.append(f"{where}: output from attempt {c['llm_attempt_id']}, the success is "
                     f"attempt {ok[0]['attempt_id']}")
        if not c["answered"]:
            v.append(f"{where}: no model output")
        started = [a for a in tries if a["outcome"] in ("started", "abandoned")]
        effects["started_attempts"] += sum(a["outcome"] == "started" for a in tries)
        effects["abandoned_attempts"] += sum(a["outcome"] == "abandoned" for a in tries)
        effects["discarded_attempts"] += sum(a["outcome"] == "discarded" for a in tries)
        for a in tries:
            if a["outcome"] == "started":
                v.append(f"{where}: orphan attempt {a['attempt_id']} left 'started'"
                         + (" by the final run" if a["run_token"] == final else ""))
            elif a["outcome"] == "abandoned" and a["run_token"] == final:
                v.append(f"{where}: attempt {a['attempt_id']} of the final run abandoned")
        for a in tries:
            if a["outcome"] not in ("succeeded", "started", *FAILED_OUTCOMES):
                v.append(f"{where}: attempt {a['attempt_id']} has outcome {a['outcome']}")
        calls = calls_by_key.get(f"{jid}:{idx}", 0)
        if not len(tries) - len(started) <= calls <= len(tries):
            v.append(f"{where}: the provider saw {calls} calls, provider_attempt has "
                     f"{len(tries)} rows ({len(started)} started or abandoned)")
        llm = stage_of.get((jid, "llm"))
        late = [a for a in tries if llm and llm["finished_at"]
                and a["started_at"] > llm["finished_at"]]
        if late:
            v.append(f"{where}: {len(late)} provider attempts after llm finished")
    for key in set(calls_by_key) - {f"{j}:{i}" for j, i in chunk_keys}:
        if key.split(":", 1)[0] in job_ids:
            v.append(f"the provider saw {calls_by_key[key]} calls for {key}, not a chunk")
    effects["provider_calls"] = sum(calls_by_key.values())

    # 5. the auditor of a running system (jobstream verify) finds nothing broken either,
    # orphan attempts included: a killed run's attempt is closed 'abandoned' by whoever takes
    # its stage over.
    from jobstream import verify
    report = verify.run(settings, tenant=tenant, grace_s=0, outbox_age_s=0, max_lag=0)
    v += [f"verify: {f}" for f in report.broken]
    v += [f"verify: {name} could not run: {why}" for name, why in report.errors.items()]
    return v, dict(effects)


# ------------------------------------------------------------------------------ one point

class _Runner(ProcessRunner):
    """The run's child processes (``python -m jobstream.cli …``), their logs and deaths."""

    def launch(self, command: str, *, fault: str | None = None) -> Proc:
        """Start ``jobstream <command>``, with ``fault`` armed in it if given."""
        # The downstream logs each outcome (applied/duplicate) at debug level.
        args = ["--log-level", "debug", command] if command == "consume-ready" else [command]
        return self.start(*args, name=command, **({"JOBSTREAM_FAULT": fault} if fault else {}))


def _wait(pred: Callable[[], Any], timeout_s: float, every_s: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if got := pred():
            return got
        time.sleep(every_s)
    return None


def quiescent(settings: Settings, tenant: str, n_jobs: int) -> bool:
    """Every job terminal and applied downstream, the outbox drained, and every consumer group
    committed to the end of its topics (so no duplicate is still on its way)."""
    with connect(settings.database_url, autocommit=True) as conn:
        jobs = conn.execute(Q["inv_jobs"], (tenant,)).fetchall()
        outbox = conn.execute(Q["inv_outbox"], {"tenant": tenant}).fetchall()
        applied = {r["dedup_key"] for r in conn.execute(Q["inv_analyses"], (tenant,))}
    if len(jobs) < n_jobs or any(j["status"] not in TERMINAL for j in jobs):
        return False
    if any(not o["published"] for o in outbox):
        return False
    if any(j["status"] == "succeeded" and j["dedup_key"] not in applied for j in jobs):
        return False
    return (group_lag(settings, settings.group("jobstream-streams"),
                      [settings.topic(t) for t in WORKER_TOPICS]) == 0
            and group_lag(settings, settings.group(DOWNSTREAM_GROUP),
                          [settings.topic("job.ready")]) == 0)


def _proc_state(proc: Proc) -> str:
    """The process state letter from /proc (``T``: stopped), ``X`` once it is gone."""
    try:
        with open(f"/proc/{proc.popen.pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def as_pause(fault: str) -> str:
    """The fault spec with the ``stop`` action (SIGSTOP instead of SIGKILL)."""
    return fault if fault.endswith("=stop") else fault.split("=", 1)[0] + "=stop"


def run_point(base: Settings, fault: str, *, jobs: int, logdir: Path,
              timeout_s: float = 150.0, mode: str = "kill",
              pause_s: float | None = None) -> PointResult:
    """Run one fault point of the matrix on ``base``'s database and topics (see the module
    docstring); returns what happened, never raises for an invariant violation.

    ``mode``: ``kill`` (SIGKILL at the point, restart) or ``pause`` (SIGSTOP there for
    ``pause_s`` seconds, default lease + sweep grace + Kafka session + 3 s, then SIGCONT; a
    frozen worker only until the second worker has finished every job, ``pause_s`` at most:
    see the module docstring). Raises ``ValueError`` for another mode.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    owner = owner_of(fault)
    fault = as_pause(fault) if mode == "pause" else fault
    result = PointResult(fault, owner, jobs, logdir=logdir, mode=mode)
    t0 = time.monotonic()
    run_id = uuid.uuid4().hex[:8]
    tenant = f"chaos-{run_id}"
    with FakeProvider() as fake:
        settings = chaos_settings(base, fake.base_url)
        if mode == "pause":  # the sweeper races the takeover
            settings = settings.model_copy(update={"sweep_grace_s": 3.0})
        runner = _Runner(settings_env(settings), logdir)
        try:
            armed = None
            for command in ("relay", "worker", "consume-ready"):
                p = runner.launch(command, fault=fault if command == owner else None)
                armed = p if command == owner else armed
            assert armed is not None
            docs = make_documents(logdir / "docs", run_id, jobs)
            keys = [f"{tenant}:{d.name}" for d in docs]
            submit(settings, [uploaded_event(d, tenant_id=tenant, idempotency_key=k,
                                             settings=settings, model_profile="custom")
                              for d, k in zip(docs, keys, strict=True)])
            def fired() -> str | None:
                if mode == "pause" and _proc_state(armed) == "T":
                    return "paused"
                if armed.popen.poll() is not None or runner.dead(besides=armed):
                    return "exited"
                # Every job done and the point never reached: its hit N is beyond the batch.
                return "finished" if quiescent(settings, tenant, jobs) else None
            outcome = _wait(fired, timeout_s, every_s=0.5 if mode == "pause" else 1.0)
            if outcome not in ("exited", "paused"):
                result.violations.append(
                    f"{fault} never fired " + ("before every job had finished (is N beyond "
                                               "this batch?)" if outcome == "finished"
                                               else f"within {timeout_s:.0f}s"))
                return result
            if others := runner.dead(besides=armed):
                result.violations.append(f"{[p.name for p in others]} died unexpectedly")
                return result
            if mode == "pause":
                if outcome != "paused":
                    result.violations.append(f"{owner} exited with {armed.popen.returncode}, "
                                             "not paused")
                    return result
                result.paused = True
                wait = pause_s if pause_s is not None else (
                    settings.lease_s + settings.sweep_grace_s
                    + settings.consumer_session_timeout_ms / 1000 + 3)
                frozen_at = time.monotonic()
                if owner == "worker":  # a second worker takes over the frozen one's work
                    runner.launch("worker")
                    # Frozen until that worker has finished every job (quiescent: which needs
                    # the frozen member evicted from the group and its runs fenced), ``wait``
                    # at most: later, the resumed worker would find the same world.
                    _wait(lambda: quiescent(settings, tenant, jobs), wait)
                else:  # nobody takes a relay's or an applier's work over: a fixed freeze
                    time.sleep(wait)
                result.frozen_s = time.monotonic() - frozen_at
                os.kill(armed.popen.pid, signal.SIGCONT)
                expect_dead: list[Proc] = []
            else:
                result.killed_rc = armed.popen.returncode
                if result.killed_rc != -9:
                    result.violations.append(
                        f"{owner} exited with {result.killed_rc}, not SIGKILL")
                    return result
                runner.launch(owner)
                expect_dead = [armed]
            if not _wait(lambda: runner.dead() != expect_dead
                         or quiescent(settings, tenant, jobs), timeout_s, every_s=1.0):
                result.violations.append(f"not quiescent within {timeout_s:.0f}s after the "
                                         + ("SIGCONT" if mode == "pause" else "restart"))
            elif runner.dead() != expect_dead:
                result.violations.append(
                    f"{[p.name for p in runner.dead() if p is not armed]} died unexpectedly")
            else:
                v, effects = check_invariants(
                    settings, tenant=tenant, keys=keys,
                    calls_by_key=fake.snapshot()["by_key"], worker_killed=owner == "worker",
                    redrives=mode == "pause")
                result.violations += v
                result.effects = effects
                if mode == "pause":  # the auditor of a running system must agree
                    audit = subprocess.run(
                        [sys.executable, "-m", "jobstream.cli", "verify", "--tenant", tenant,
                         "--grace", "1"], env=runner.env(), capture_output=True, text=True,
                        timeout=120)
                    if audit.returncode != 0:
                        result.violations.append(f"jobstream verify exit {audit.returncode}: "
                                                 f"{audit.stdout[-2000:]}{audit.stderr[-500:]}")
                result.effects["downstream_redeliveries_skipped"] = sum(
                    _count_lines(p, " duplicate ") for p in runner.procs
                    if p.name.startswith("consume-ready"))
                if owner == "worker":
                    result.effects["redelivered_skips"] = sum(
                        _count_lines(p, "-> skipped:duplicate") for p in runner.procs
                        if p is not armed and p.name.startswith("worker"))
                    result.effects["stale_runs"] = sum(
                        _count_lines(p, "-> stale") for p in runner.procs)
        finally:
            # Everything the point checks was read: SIGKILL, not SIGTERM (a worker resumed
            # after SIGSTOP ignores SIGTERM and cost the point a 20 s stop timeout).
            runner.kill_all()
            result.seconds = time.monotonic() - t0
            if result.violations:
                result.log_tails = runner.logs(2000)
    return result


def _count_lines(proc: Proc, needle: str) -> int:
    return sum(needle in line for line in proc.log.read_text(errors="replace").splitlines())


# ------------------------------------------------------------------------------ the command

def scratch_database(url: str, name: str) -> str:
    """Create (and migrate) database ``name`` on the server of ``url``; returns its URL."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    scratch = psycopg.conninfo.make_conninfo(url, dbname=name)
    migrate(scratch)
    return scratch


def drop_database(url: str, name: str) -> None:
    """Drop database ``name`` on the server of ``url`` (closing its connections)."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
            sql.Identifier(name)))


def run_matrix(settings: Settings, faults: list[str], *, jobs: int, workdir: Path,
               keep: bool = False,
               on_result: Callable[[PointResult], None] | None = None,
               mode: str = "kill") -> list[PointResult]:
    """Run every fault of ``faults`` in turn (``mode``: ``kill`` or ``pause``, see
    :func:`run_point`), each in a scratch database and its own topic prefix on the configured
    servers (dropped afterwards unless ``keep`` or it failed)."""
    results = []
    for fault in faults:
        owner_of(fault)  # fail fast on a typo
        run = f"chaos_{uuid.uuid4().hex[:8]}"
        url = scratch_database(settings.database_url, run)
        s = settings.model_copy(update={"database_url": url, "topic_prefix": f"{run}.",
                                        "relay_poll_interval_s": 0.2,
                                        "consumer_session_timeout_ms": 6000,
                                        "provider_backoff_base_s": 0.05})
        try:
            ensure_topics(s)
            res = run_point(s, fault, jobs=jobs, logdir=workdir / run, mode=mode)
        except BaseException:  # interrupted (Ctrl-C, SIGTERM) or the services failed
            with contextlib.suppress(Exception):
                drop_database(settings.database_url, run)
                delete_topics(s)
            raise
        results.append(res)
        if on_result:
            on_result(res)
        if res.ok and not keep:
            drop_database(settings.database_url, run)
            delete_topics(s)
    return results
