"""Apply rate of ``job.ready`` through the idempotent consumer, next to raw consume, decode and the
same handler applied at-least-once.

For each duplicate share (``--dups``, default 0 and 30 percent) the run produces ``--n``
``job.ready`` messages (realistic results, ~1 KB) to a topic of its own, where that share of the
messages are re-deliveries: byte-identical copies of an earlier event (same key, same
partition, later offset). The same messages are then read by three consumers, each in its own
group, one after another:

* ``raw``: poll + ``store_offsets`` (offsets auto-committed): what Kafka and the client cost;
* ``decode``: the same plus ``schemas.events.decode_event`` (pydantic validation);
* ``at_least_once``: the same consumer, handler and batches as ``idempotent`` with the
  ``processed_event`` insert/check taken out: every delivered message is applied (duplicates
  too), in one transaction per batch, offsets stored after the commit. What the effect costs
  without the guarantee; ``idempotent / at_least_once`` is the price of the guarantee itself.
* ``idempotent``: ``jobstream.ready_applier`` (``IdempotentConsumer`` + ``apply_ready`` /
  ``apply_ready_batch``): the ``processed_event`` insert and the two effect rows in one
  Postgres transaction per batch, the offset stored after the commit. Its dedup table
  (``--dedup-table``): ``digest`` (default), the library's current table
  (``consumers.ddl.create_tables`` in schema ``consumer_bench``: a 16-byte ``key_digest``
  primary key), or ``jobstream``, jobstream's own ``processed_event`` (shared with the stage
  agents; the same ``key_digest`` primary key since migration 0026, with the SQL function
  ``processed_event_key`` its stage queries use).

Rate = messages / (first message handed to the application .. last offset stored). Before each
apply run the effect tables and ``processed_event`` are emptied; after each idempotent run the
effect rows are counted: each unique event must be applied exactly once. With ``--rounds N``
the two apply runs alternate N times and the best of each is reported (the machine is shared:
the ratio of runs next to each other is what counts).
"""

from __future__ import annotations

import os
import random
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, KafkaError, Message, Producer
from psycopg import sql

from bench.common import (
    base_parser,
    create_topics,
    emit,
    isolated,
    log,
    machine,
    pyplot,
)
from consumers.ddl import create_tables
from consumers.idempotent import IdempotentConsumer
from jobstream.db import connect
from jobstream.kafka import consumer_config, producer_config
from jobstream.ready_applier import (
    apply_ready,
    apply_ready_batch,
    apply_ready_batch_json,
    apply_ready_rows,
    copy_rows,
    idempotent_consumer,
)
from jobstream.settings import Settings
from jobstream.store import outbox_message
from schemas.events import DocumentAnalysis, JobReady, JobReadyPayload, decode_event

#: Issue 12's targets: idempotent apply rate (messages/s) and its ratio to the at-least-once
#: apply of the same handler in the same run.
TARGET_RATE = 30_000
TARGET_RATIO = 0.7
#: Schema of the library-shaped dedup table of ``--dedup-table digest``.
BENCH_SCHEMA = "consumer_bench"


def ready_event(tenant: str, i: int) -> JobReady:
    """A realistic ``job.ready`` (a licence-like analysis, ~1 KB encoded)."""
    return JobReady(
        tenant_id=tenant, idempotency_key=f"{tenant}:{i}", job_id=uuid.uuid4(),
        dedup_key=uuid.uuid4().hex * 2,
        payload=JobReadyPayload(
            result=DocumentAnalysis(
                title=f"GNU GENERAL PUBLIC LICENSE {i}",
                summary=("This License applies to any program or other work which contains a "
                         "notice placed by the copyright holder saying it may be distributed "
                         "under the terms of this General Public License. ") * 3,
                keywords=["license", "program", "software", "copyright", "distribute",
                          "source", "code", "work", "terms", "modify"],
                word_count=2968, chunk_count=5,
                fields={"licence_name": "GPL", "version": "2", "years": ["1989", "1991"]}),
            document_sha256="a" * 64, filename=f"doc-{i}.txt", cost_usd=0.0012,
            charge_usd=0.01))


def produce_scenario(settings: Settings, topic: str, n: int, dup_pct: float,
                     tenant: str) -> dict[str, int]:
    """Produce ``n`` messages to ``topic``, ``dup_pct`` percent of them re-deliveries."""
    dups = int(round(n * dup_pct / 100))
    uniques = n - dups
    rng = random.Random(42)
    order: list[tuple[float, bytes, bytes, list[tuple[str, bytes]]]] = []
    msgs = []
    for i in range(uniques):
        m = outbox_message(topic, ready_event(tenant, i))
        hdrs = [(k, v.encode()) for k, v in m.headers.items()]
        msgs.append((m.key.encode(), m.value, hdrs))
        order.append((float(i), *msgs[-1]))
    for _ in range(dups):
        k = rng.randrange(uniques)
        order.append((rng.uniform(k + 0.5, uniques), *msgs[k]))
    order.sort(key=lambda t: t[0])
    p = Producer(producer_config(settings, **{"linger.ms": 20}))
    for _, key, value, hdrs in order:
        while True:
            try:
                p.produce(topic, key=key, value=value, headers=hdrs)
                break
            except BufferError:
                p.poll(0.05)
        p.poll(0)
    if p.flush(120):
        raise RuntimeError("messages not delivered")
    return {"messages": n, "unique": uniques, "duplicates": dups}


class TimedConsumer:
    """Wraps a confluent-kafka Consumer: records when the first message was handed out and
    when the last offset was stored."""

    def __init__(self, inner: Consumer) -> None:
        self._inner = inner
        self.first: float | None = None
        self.last_store = 0.0

    def _seen(self, got: Any) -> Any:
        if got and self.first is None:
            self.first = time.monotonic()
        return got

    def poll(self, *a: Any, **kw: Any) -> Message | None:
        m = self._inner.poll(*a, **kw)
        if m is not None and m.error() is None:
            self._seen(m)
        return m

    def consume(self, *a: Any, **kw: Any) -> list[Message]:
        ms = self._inner.consume(*a, **kw)
        return self._seen(ms) if any(m.error() is None for m in ms) else ms

    def store_offsets(self, *a: Any, **kw: Any) -> None:
        self._inner.store_offsets(*a, **kw)
        self.last_store = time.monotonic()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def run_plain(settings: Settings, topic: str, n: int, decode: bool) -> dict[str, Any]:
    """poll (+ decode) + store_offsets for ``n`` messages in a fresh group."""
    c = Consumer(consumer_config(settings, f"{settings.topic_prefix}raw-{uuid.uuid4().hex[:6]}"))
    c.subscribe([topic])
    got = 0
    first = last = 0.0
    cpu0 = time.process_time()
    deadline = time.monotonic() + 300
    try:
        while got < n and time.monotonic() < deadline:
            for m in c.consume(500, 0.5):
                if m.error():
                    if m.error().code() != KafkaError._PARTITION_EOF:
                        raise RuntimeError(m.error())
                    continue
                if not got:
                    first = time.monotonic()
                if decode:
                    decode_event(m.value(), expected=("job.ready",))
                c.store_offsets(message=m)
                got += 1
                last = time.monotonic()
    finally:
        c.close()
    if got < n:
        raise RuntimeError(f"only {got} of {n} messages consumed")
    return {"events_per_s": round(n / (last - first)), "elapsed_s": round(last - first, 3),
            "cpu_us_per_msg": {"consumer_process": round((time.process_time() - cpu0) / n * 1e6,
                                                         1)}}


def make_consumer(settings: Settings, *, dedup: bool, max_batch: int | None, handler: str,
                  decode_ahead: bool, dedup_table: str = "digest",
                  lanes: int | None = None) -> IdempotentConsumer:
    """The ready applier (``jobstream.ready_applier.build``'s handlers) in a fresh group;
    ``dedup=False``: the at-least-once baseline (no ``processed_event`` insert or check, every
    delivered message applied). ``dedup_table``: ``digest`` (the library's table in
    :data:`BENCH_SCHEMA`) or ``jobstream`` (jobstream's ``processed_event``)."""
    consumer = idempotent_consumer(settings, group=f"{settings.topic_prefix}apply-"
                                   f"{uuid.uuid4().hex[:8]}", topics=[], event_types=(),
                                   max_batch=max_batch)
    if dedup_table == "digest":  # the table of ConsumerSettings(db_schema=BENCH_SCHEMA)
        consumer._table = sql.Identifier(BENCH_SCHEMA, consumer.settings.table)
    consumer.settings = consumer.settings.model_copy(update={"decode_ahead": decode_ahead})
    if lanes is not None:
        consumer.settings = consumer.settings.model_copy(update={"apply_lanes": lanes})
    consumer.on(JobReady, topic=settings.topic("job.ready"))(apply_ready)
    if handler == "copy":  # what jobstream.ready_applier.build registers
        consumer.on_batch(JobReady, prepare=copy_rows, light=True)(apply_ready_rows)
    elif handler == "copy-models":  # the same rows from the pydantic models (before light)
        consumer.on_batch(JobReady, prepare=copy_rows)(apply_ready_rows)
    elif handler == "copy-in-apply":  # the same rows, formatted in the applying thread
        consumer.on_batch(JobReady)(apply_ready_batch)
    elif handler == "json":
        consumer.on_batch(JobReady)(apply_ready_batch_json)
    if not dedup:
        consumer._new_events = lambda conn, seen, first: list(seen)  # type: ignore[method-assign]
        consumer._record = lambda conn, event: (1,)  # type: ignore[method-assign]
    return consumer


class _Msg:
    """A fetched message as ``IdempotentConsumer._decode_all`` reads it (no broker)."""

    def __init__(self, offset: int, key: bytes, value: bytes) -> None:
        self._offset, self._key, self._value = offset, key, value

    def topic(self) -> str:
        return "job.ready"

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return self._offset

    def key(self) -> bytes:
        return self._key

    def value(self) -> bytes:
        return self._value


def decode_ahead_micro(settings: Settings, handlers: list[str], *, batch: int = 2000,
                       rounds: int = 20) -> dict[str, Any]:
    """CPU microseconds per event of the decode-ahead thread's work on a batch of ``batch``
    realistic ``job.ready`` (``IdempotentConsumer._decode_all``: decode, key digest, the batch
    handler's ``prepare``), in this process, no broker or Postgres, for each of ``handlers``
    (``copy``: light structs; ``copy-models``: pydantic models) alternated ``rounds`` times
    with the collector tuned as ``run()`` tunes it. Returns the best and the median of each."""
    import gc
    import statistics

    msgs = [_Msg(i, str(i).encode(), outbox_message("t", ready_event("acme", i)).value)
            for i in range(batch)]
    consumers = {h: make_consumer(settings, dedup=True, max_batch=None, handler=h,
                                  decode_ahead=True) for h in handlers}
    times: dict[str, list[float]] = {h: [] for h in handlers}
    thresholds = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(max(thresholds[0], 50_000), *thresholds[1:])
    try:
        for r in range(rounds):
            for h in handlers[r % len(handlers):] + handlers[:r % len(handlers)]:
                t0 = time.process_time()
                out = consumers[h]._decode_all(msgs)  # type: ignore[arg-type]  # duck-typed
                times[h].append((time.process_time() - t0) / batch * 1e6)
                del out
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()
    return {h: {"best_us": round(min(v), 2), "median_us": round(statistics.median(v), 2),
                "rounds_us": [round(x, 2) for x in v]} for h, v in times.items()}


def reset_effects(url: str) -> None:
    """Empty the effect tables and processed_event (each apply run starts from the same
    state)."""
    with connect(url) as conn:
        create_tables(conn, BENCH_SCHEMA)
        conn.execute("TRUNCATE downstream.document_analysis, downstream.ledger_charge, "
                     f"processed_event, {BENCH_SCHEMA}.processed_event")
        conn.commit()


def backend_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) of Postgres backend ``pid`` so far, from /proc (None when
    Postgres does not run on this machine)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_apply(settings: Settings, n: int, consumer: IdempotentConsumer) -> dict[str, Any]:
    """``consumer`` over the scenario's topic until every offset is stored; with its CPU per
    message (this process, and the consumer's Postgres backend, sampled after each commit)."""
    timed = TimedConsumer(consumer._consumer)
    consumer._consumer = timed  # type: ignore[assignment]
    backends: dict[int, float | None] = {}  # backend pid -> its CPU seconds (every lane's)
    after = consumer.hooks.after_apply

    def sample() -> None:
        for conn in list(consumer._conns.values()):
            pid = conn.info.backend_pid
            backends[pid] = backend_cpu_s(pid)
        if after is not None:
            after()

    consumer.hooks.after_apply = sample
    cpu0 = time.process_time()
    t = threading.Thread(target=consumer.run, daemon=True)
    t.start()
    st = consumer.stats
    deadline = time.monotonic() + 600
    while (st.applied + st.duplicates + st.dead_lettered < n and time.monotonic() < deadline
           and t.is_alive()):
        time.sleep(0.02)
    time.sleep(0.3)  # the offsets of the last message(s) are stored right after the stats
    consumer.stop()
    t.join(30)
    cpu = time.process_time() - cpu0
    done = st.applied + st.duplicates + st.dead_lettered
    if done < n or timed.first is None:
        raise RuntimeError(f"idempotent consumer handled {done} of {n} messages")
    el = timed.last_store - timed.first
    pg = (None if not backends or None in backends.values()
          else sum(v for v in backends.values() if v is not None))
    return {"events_per_s": round(n / el), "elapsed_s": round(el, 3), "applied": st.applied,
            "duplicates_skipped": st.duplicates, "dead_lettered": st.dead_lettered,
            "cpu_us_per_msg": {"consumer_process": round(cpu / n * 1e6, 1),
                               "postgres_backend": None if pg is None else round(pg / n * 1e6, 1)}}


def count_effects(url: str, tenant: str) -> dict[str, int]:
    with connect(url) as conn:
        a = conn.execute("SELECT count(*) AS n, count(DISTINCT dedup_key) AS d FROM "
                         "downstream.document_analysis WHERE tenant_id = %s",
                         (tenant,)).fetchone()
        c = conn.execute("SELECT count(*) AS n, count(DISTINCT dedup_key) AS d FROM "
                         "downstream.ledger_charge WHERE tenant_id = %s", (tenant,)).fetchone()
    assert a is not None and c is not None
    return {"analysis_rows": a["n"], "analysis_keys": a["d"], "charge_rows": c["n"],
            "charge_keys": c["d"]}


def cpu_total(run: dict[str, Any]) -> float | None:
    """CPU per message of the consumer process plus its Postgres backend (microseconds): what
    the apply costs the machine, steadier than a rate on a shared machine."""
    c = run["cpu_us_per_msg"]
    return None if c["postgres_backend"] is None else round(
        c["consumer_process"] + c["postgres_backend"], 1)


def scenario(base: Settings, n: int, dup_pct: float, args: Any) -> dict[str, Any]:
    s = base.model_copy(update={"topic_prefix": f"{base.topic_prefix}d{int(dup_pct)}."})
    topic = s.topic("job.ready")
    create_topics(s, [topic, topic + ".dlq"], partitions=s.topic_partitions)
    tenant = f"bench-d{int(dup_pct)}"
    log(f"dups {dup_pct}%: producing {n} job.ready")
    produced = produce_scenario(s, topic, n, dup_pct, tenant)
    raw = run_plain(s, topic, n, decode=False)
    log(f"dups {dup_pct}%: raw {raw['events_per_s']}/s")
    dec = run_plain(s, topic, n, decode=True)
    log(f"dups {dup_pct}%: decode {dec['events_per_s']}/s")
    kw = {"max_batch": args.max_batch, "handler": args.handler,
          "decode_ahead": not args.no_decode_ahead, "dedup_table": args.dedup_table,
          "lanes": args.lanes}
    alo_runs, idem_runs, ok = [], [], True
    compare = [int(x) for x in (args.compare_lanes or "").split(",") if x.strip()]
    by_lanes: dict[int, list[dict[str, Any]]] = {lanes: [] for lanes in compare}
    effects: dict[str, int] = {}
    for r in range(args.rounds):
        reset_effects(s.database_url)
        alo_runs.append(run_apply(s, n, make_consumer(s, dedup=False, **kw)))
        log(f"dups {dup_pct}%: round {r + 1}: at-least-once {alo_runs[-1]['events_per_s']}/s")
        reset_effects(s.database_url)
        idem_runs.append(run_apply(s, n, make_consumer(s, dedup=True, **kw)))
        log(f"dups {dup_pct}%: round {r + 1}: idempotent {idem_runs[-1]['events_per_s']}/s")
        effects = count_effects(s.database_url, tenant)
        ok = ok and (effects["analysis_rows"] == effects["analysis_keys"] == produced["unique"]
                     == effects["charge_rows"] == effects["charge_keys"]
                     == idem_runs[-1]["applied"])
        # the same idempotent apply with each lane count; the order rotates every round
        for lanes in compare[r % len(compare):] + compare[:r % len(compare)] if compare else []:
            reset_effects(s.database_url)
            run = run_apply(s, n, make_consumer(s, dedup=True, **{**kw, "lanes": lanes}))
            by_lanes[lanes].append(run)
            log(f"dups {dup_pct}%: round {r + 1}: idempotent, {lanes} lane(s) "
                f"{run['events_per_s']}/s")
            effects = count_effects(s.database_url, tenant)
            ok = ok and (effects["analysis_rows"] == effects["analysis_keys"]
                         == produced["unique"] == effects["charge_rows"]
                         == effects["charge_keys"] == run["applied"])
    alo = max(alo_runs, key=lambda x: x["events_per_s"])
    idem = max(idem_runs, key=lambda x: x["events_per_s"])
    return {"dup_pct": dup_pct, "loadavg_1_5_15_at_end": list(os.getloadavg()), **produced,
            "raw_consume_commit": raw,
            "consume_decode_commit": dec, "at_least_once_apply": alo, "idempotent_apply": idem,
            "rounds": {"at_least_once_events_per_s": [x["events_per_s"] for x in alo_runs],
                       "idempotent_events_per_s": [x["events_per_s"] for x in idem_runs],
                       "at_least_once_cpu_us_per_msg": [cpu_total(x) for x in alo_runs],
                       "idempotent_cpu_us_per_msg": [cpu_total(x) for x in idem_runs],
                       "idempotent_postgres_us_per_msg": [
                           x["cpu_us_per_msg"]["postgres_backend"] for x in idem_runs]},
            "dedup_table": args.dedup_table,
            "idempotent_vs_raw_ratio": round(idem["events_per_s"] / raw["events_per_s"], 3),
            "idempotent_vs_at_least_once_ratio": round(
                idem["events_per_s"] / alo["events_per_s"], 3),
            "cpu_us_per_msg_consumer_plus_postgres": {
                "at_least_once": cpu_total(alo), "idempotent": cpu_total(idem)},
            "effects": effects, "exactly_once_ok": ok,
            **({"compare_lanes": compare_lanes(by_lanes)} if compare else {})}


def compare_lanes(by_lanes: dict[int, list[dict[str, Any]]]) -> dict[str, Any]:
    """``--compare-lanes``: per lane count, each round's idempotent rate and CPU per message
    (consumer process + every lane's Postgres backend), their medians, and in how many rounds
    each lane count was the fastest (the runs alternate within a round: load drifts less
    between them than between two bench processes)."""
    import statistics
    out: dict[str, Any] = {}
    for lanes, runs in by_lanes.items():
        rates = [x["events_per_s"] for x in runs]
        cpus = [cpu_total(x) for x in runs]
        out[str(lanes)] = {"events_per_s": rates, "median_events_per_s": statistics.median(rates),
                           "cpu_us_per_msg": cpus,
                           "postgres_us_per_msg": [x["cpu_us_per_msg"]["postgres_backend"]
                                                   for x in runs]}
    rounds = zip(*[[x["events_per_s"] for x in runs] for runs in by_lanes.values()],
                 strict=True)
    wins = [list(by_lanes)[max(range(len(r)), key=r.__getitem__)] for r in rounds]
    out["fastest_in_rounds"] = {str(lanes): wins.count(lanes) for lanes in by_lanes}
    return out


def plot(result: dict[str, Any], path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = ["raw consume+commit", "+ decode", "at-least-once apply", "idempotent apply"]
    keys = ["raw_consume_commit", "consume_decode_commit", "at_least_once_apply",
            "idempotent_apply"]
    width = 0.8 / len(result["scenarios"])
    for i, sc in enumerate(result["scenarios"]):
        xs = [j + i * width for j in range(len(keys))]
        ax.bar(xs, [sc[k]["events_per_s"] for k in keys], width,
               label=f"{sc['dup_pct']:.0f}% duplicates")
    ax.set_xticks([j + width * (len(result["scenarios"]) - 1) / 2 for j in range(len(keys))],
                  labels)
    ax.axhline(TARGET_RATE, color="red", ls="--", lw=1, label=f"target {TARGET_RATE}/s")
    ax.set_yscale("log")
    ax.set_ylabel("events/s")
    ax.set_title(f"job.ready, {result['params']['n']} messages")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--n", type=float, default=1e4, help="messages per scenario")
    p.add_argument("--dups", default="0,30", help="duplicate percentages, comma-separated")
    p.add_argument("--max-batch", type=int,
                   help="override IdempotentConsumer.max_batch (1 = a transaction per message; "
                        "default: ConsumerSettings.batch_size)")
    p.add_argument("--handler",
                   choices=["copy", "copy-models", "copy-in-apply", "json", "per-event"],
                   default="copy",
                   help="batch handler: binary rows (one array per table, INSERT ... SELECT "
                        "FROM unnest; binary COPY before consumer6) prepared in the decode-ahead "
                        "thread from the fast path's structs, no model built (copy_rows + "
                        "apply_ready_rows, light=True: default), the same from the pydantic "
                        "models (copy-models: before perf-consumer9), the same rows "
                        "formatted in the applying thread (apply_ready_batch), jsonb "
                        "multi-row INSERTs (apply_ready_batch_json), or none (the per-event "
                        "handler for each new event, pipelined)")
    p.add_argument("--no-decode-ahead", action="store_true",
                   help="decode each batch in the applying thread (decode_ahead=False)")
    p.add_argument("--dedup-table", choices=["digest", "jobstream"], default="digest",
                   help="the idempotent apply's dedup table: the library's (schema "
                        "consumer_bench; default) or jobstream's own processed_event (both "
                        "keyed by the 16-byte key_digest since migration 0026)")
    p.add_argument("--lanes", type=int,
                   help="override ConsumerSettings.apply_lanes (Postgres connections applying "
                        "the partitions of a batch concurrently; 1 = one transaction per "
                        "batch; default: the setting's default)")
    p.add_argument("--compare-lanes", metavar="N,M",
                   help="also run the idempotent apply with each of these apply_lanes values "
                        "in every round, alternated (e.g. 1,2), and report them side by side")
    p.add_argument("--rounds", type=int, default=3,
                   help="alternate the at-least-once and idempotent runs this many times; "
                        "the best of each is reported")
    p.add_argument("--decode-micro", metavar="H,H",
                   help="only measure the decode-ahead thread's CPU per event in-process for "
                        "these handlers, alternated (e.g. copy,copy-models), and exit")
    args = p.parse_args()
    args.n = int(args.n)
    if args.decode_micro:
        emit({"benchmark": "consumer-decode-micro", "machine": machine(),
              "decode_ahead_us_per_event": decode_ahead_micro(
                  Settings(), args.decode_micro.split(",")),
              "loadavg_after": list(os.getloadavg())})
        return
    result: dict[str, Any] = {"benchmark": "consumer", "machine": machine(),
                              "params": {k: v for k, v in vars(args).items() if k != "plot"},
                              "scenarios": []}
    with isolated(args, "cons") as s:
        for d in [float(x) for x in args.dups.split(",") if x.strip()]:
            result["scenarios"].append(scenario(s, args.n, d, args))
    result["machine"]["loadavg_after"] = list(__import__("os").getloadavg())
    result["targets_met"] = {}
    for sc in result["scenarios"]:
        d = f"{sc['dup_pct']:.0f}%_dups"
        result["targets_met"][f"apply>={TARGET_RATE}/s_at_{d}"] = (
            sc["idempotent_apply"]["events_per_s"] >= TARGET_RATE)
        result["targets_met"][f"apply>={TARGET_RATIO}x_at_least_once_at_{d}"] = (
            sc["idempotent_vs_at_least_once_ratio"] >= TARGET_RATIO)
        result["targets_met"][f"exactly_once_at_{d}"] = sc["exactly_once_ok"]
    if args.plot:
        plot(result, args.plot)
        result["plot"] = args.plot
    emit(result)


if __name__ == "__main__":
    main()
