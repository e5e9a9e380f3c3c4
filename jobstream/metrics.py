"""Prometheus metrics, computed from Postgres and Kafka when scraped.

Workers, relays and consumers are separate processes (often many), so in-process counters
would each see a slice and reset on restart. The facts are already durable: jobs, stage
checkpoints, the provider call log and the outbox in Postgres, committed offsets in Kafka. A
custom collector (:class:`JobstreamCollector`) reads them at scrape time, so any one process
can export the whole pipeline's numbers: the API at ``/metrics`` and ``jobstream metrics
--port`` for deployments without the API (docs/design-notes.md, "Metrics").

Metrics (all prefixed ``jobstream_``; seconds and USD as in the names):

============================================ ========= ==========================================
name                                         type      source
============================================ ========= ==========================================
jobs_created_total{lane}                     counter   job rows (never deleted)
jobs_accepted{lane}                          gauge     jobs in status ``succeeded``
jobs{lane,status}                            gauge     job rows per status
stage_runs_total{stage}                      counter   sum(job_stage.attempt)
stage_retries_total{stage}                   counter   sum(attempt - 1): runs with attempt > 1
job_retry_rate                               gauge     stage_retries / stage_runs (0..1)
lease_expired_total{stage}                   counter   claims that took over an expired lease
leases_expired{stage}                        gauge     running stages whose lease expired now
provider_attempts_total{outcome,model_profile} counter finished provider_attempt rows
provider_attempts_in_flight{model_profile}   gauge     provider_attempt rows still ``started``
provider_unknown_outcomes_total{model_profile} counter outcome ``outcome_unknown`` or ``abandoned``
provider_rate_limited_total{model_profile}   counter   attempts the provider answered 429
provider_cost_usd_total{model_profile}       counter   sum(provider_attempt.cost_usd)
cost_per_accepted_job_usd                    gauge     provider cost (all attempts, all jobs) /
                                                       accepted jobs; NaN before the first
queue_wait_seconds{stage,lane}               gauge histogram  previous checkpoint's finish ->
                                                       this stage's claim, stages finished in
                                                       the last ``metrics_window_s``
stage_duration_seconds{stage,lane}           gauge histogram  claim -> checkpoint, same window
provider_latency_seconds{model_profile,lane} gauge histogram  provider attempts' latency, same
                                                       window
outbox_backlog                               gauge     unpublished outbox rows
outbox_oldest_age_seconds                    gauge     age of the oldest unpublished row
replication_slot_retained_bytes{slot}        gauge     WAL held back by a logical slot (bytes)
replication_slot_active{slot}                gauge     1 when the slot is being streamed
dead_letters_stored{source,reason_code}      gauge     dead_letter rows not replayed (a DLQ
                                                       that refused them, relay-parked rows)
consumer_lag_messages{group,topic}           gauge     high watermark - committed offset
consumer_group_lag_messages{group}           gauge     the same, summed per group
topic_produced_total{topic}                  counter   messages ever written to a ``.retry`` /
                                                       ``.dlq`` twin (sum of high watermarks)
topic_retained_messages{topic}               gauge     messages a twin holds now (high - low)
provider_limit_window{profile}               gauge     the shared AIMD window (calls in flight)
provider_limit_max{profile}                  gauge     the window's ceiling
provider_limit_in_flight{profile}            gauge     slots of the shared limit held now
provider_limit_decreases_total{profile}      counter   times a 429 halved the window
metrics_source_up{source}                    gauge     1 when postgres/kafka answered
metrics_source_duration_seconds{source}      gauge     time to read the source this scrape
============================================ ========= ==========================================
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import ConsumerGroupTopicPartitions, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec
from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeHistogramMetricFamily,
    GaugeMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from jobstream.errors import RetryableError
from jobstream.kafka import base_config
from jobstream.settings import Settings
from jobstream.store import Store

log = logging.getLogger("jobstream.metrics")

#: Histogram bucket bounds (seconds): sub-second stage hops up to hour-long batch waits.
BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
             1800.0, 3600.0)
NS = "jobstream"


def _histogram(name: str, doc: str, rows: Iterable[dict[str, Any]],
               bounds: tuple[float, ...] = BUCKETS_S,
               labels: tuple[str, str] = ("stage", "lane")) -> GaugeHistogramMetricFamily:
    """A gauge histogram per (stage, lane) (or the two ``labels``) from rows ``(stage, lane,
    idx, n, sum_s)``: ``n`` values fell in bucket ``idx`` (value <= ``bounds[idx]``;
    ``idx == len(bounds)``: above every bound). Buckets are cumulative, as Prometheus
    expects."""
    fam = GaugeHistogramMetricFamily(name, doc, labels=list(labels))
    per: dict[tuple[str, str], tuple[list[int], list[float]]] = {}
    for r in rows:
        counts, total = per.setdefault((r[labels[0]], r[labels[1]]),
                                       ([0] * (len(bounds) + 1), [0.0]))
        counts[min(int(r["idx"]), len(bounds))] += int(r["n"])
        total[0] += float(r["sum_s"] or 0.0)
    for (stage, lane), (counts, total) in sorted(per.items()):
        cum, buckets = 0, []
        for bound, n in zip((*bounds, math.inf), counts, strict=True):
            cum += n
            buckets.append(("+Inf" if bound == math.inf else repr(float(bound)), float(cum)))
        fam.add_metric([stage, lane], buckets, gsum_value=total[0])
    return fam


def postgres_families(snap: dict[str, list[dict[str, Any]]]) -> list[Metric]:
    """The metric families of one Postgres snapshot (:meth:`Store.metrics_snapshot`)."""
    created = CounterMetricFamily(f"{NS}_jobs_created", "Jobs created (one per tenant and "
                                  "dedup key).", labels=["lane"])
    accepted = GaugeMetricFamily(f"{NS}_jobs_accepted", "Jobs accepted: status succeeded "
                                 "(a redrive of a succeeded job leaves it until it succeeds "
                                 "again, hence a gauge).", labels=["lane"])
    by_status = GaugeMetricFamily(f"{NS}_jobs", "Jobs per status.", labels=["lane", "status"])
    lanes: dict[str, list[int]] = {}
    for r in snap["jobs"]:
        tot = lanes.setdefault(r["lane"], [0, 0])
        tot[0] += int(r["n"])
        tot[1] += int(r["n"]) if r["status"] == "succeeded" else 0
        by_status.add_metric([r["lane"], r["status"]], int(r["n"]))
    for lane, (n, ok) in sorted(lanes.items()):
        created.add_metric([lane], n)
        accepted.add_metric([lane], ok)

    runs = CounterMetricFamily(f"{NS}_stage_runs", "Stage runs (claims), retries included.",
                               labels=["stage"])
    retries = CounterMetricFamily(f"{NS}_stage_retries", "Stage runs with attempt > 1.",
                                  labels=["stage"])
    takeovers = CounterMetricFamily(f"{NS}_lease_expired", "Stage claims that took over a "
                                    "run whose lease had expired.", labels=["stage"])
    expired = GaugeMetricFamily(f"{NS}_leases_expired", "Running stages whose lease has "
                                "expired (a dead or hung run the sweeper will re-drive).",
                                labels=["stage"])
    all_runs = all_retries = 0
    for r in snap["stage_runs"]:
        runs.add_metric([r["stage"]], int(r["runs"]))
        retries.add_metric([r["stage"]], int(r["retries"]))
        takeovers.add_metric([r["stage"]], int(r["lease_takeovers"]))
        expired.add_metric([r["stage"]], int(r["expired_now"]))
        all_runs += int(r["runs"])
        all_retries += int(r["retries"])
    rate = GaugeMetricFamily(f"{NS}_job_retry_rate", "Stage runs with attempt > 1 / stage "
                             "runs, over every job (0 before the first run).",
                             value=all_retries / all_runs if all_runs else 0.0)

    attempts = CounterMetricFamily(f"{NS}_provider_attempts", "Finished provider attempts.",
                                   labels=["outcome", "model_profile"])
    in_flight = GaugeMetricFamily(f"{NS}_provider_attempts_in_flight", "Provider attempts "
                                  "sent and not finished (or whose worker died).",
                                  labels=["model_profile"])
    unknown = CounterMetricFamily(f"{NS}_provider_unknown_outcomes", "Provider attempts "
                                  "whose outcome is unknown (timeout after sending).",
                                  labels=["model_profile"])
    cost = CounterMetricFamily(f"{NS}_provider_cost_usd", "Provider cost of every attempt "
                               "(USD).", labels=["model_profile"])
    limited = CounterMetricFamily(f"{NS}_provider_rate_limited", "Provider attempts answered "
                                  "429 (rate limited).", labels=["model_profile"])
    cost_by: dict[str, float] = {}
    unknown_by: dict[str, int] = {}
    limited_by: dict[str, int] = {}
    for r in snap["provider_attempts"]:
        profile = r["model_profile"]
        cost_by[profile] = cost_by.get(profile, 0.0) + float(r["cost_usd"])
        unknown_by.setdefault(profile, 0)
        limited_by[profile] = limited_by.get(profile, 0) + int(r.get("rate_limited") or 0)
        if r["outcome"] == "started":
            in_flight.add_metric([profile], int(r["n"]))
            continue
        attempts.add_metric([r["outcome"], profile], int(r["n"]))
        if r["outcome"] in ("outcome_unknown", "abandoned"):  # abandoned: run died mid-call
            unknown_by[profile] += int(r["n"])
    for profile in sorted(cost_by):
        cost.add_metric([profile], cost_by[profile])
        unknown.add_metric([profile], unknown_by[profile])
        limited.add_metric([profile], limited_by[profile])
    n_accepted = sum(ok for _, ok in lanes.values())
    per_job = GaugeMetricFamily(
        f"{NS}_cost_per_accepted_job_usd", "Provider cost of every attempt of every job "
        "(failed ones included) / accepted jobs (USD); NaN while no job is accepted.",
        value=sum(cost_by.values()) / n_accepted if n_accepted else math.nan)

    ob = snap["outbox"][0] if snap["outbox"] else {"n": 0, "oldest_s": 0}
    backlog = GaugeMetricFamily(f"{NS}_outbox_backlog", "Outbox rows not yet published.",
                                value=int(ob["n"]))
    age = GaugeMetricFamily(f"{NS}_outbox_oldest_age_seconds", "Age of the oldest "
                            "unpublished outbox row (0 when none).", value=float(ob["oldest_s"]))
    window = GaugeMetricFamily(f"{NS}_provider_limit_window", "The shared AIMD concurrency "
                               "window: provider calls allowed in flight.", labels=["profile"])
    ceiling = GaugeMetricFamily(f"{NS}_provider_limit_max", "The window's ceiling.",
                                labels=["profile"])
    holding = GaugeMetricFamily(f"{NS}_provider_limit_in_flight", "Slots of the shared limit "
                                "held now.", labels=["profile"])
    halved = CounterMetricFamily(f"{NS}_provider_limit_decreases", "Times a 429 halved the "
                                 "window.", labels=["profile"])
    for r in snap.get("provider_limit", []):
        window.add_metric([r["profile"]], float(r["limit_now"]))
        ceiling.add_metric([r["profile"]], float(r["max_limit"]))
        holding.add_metric([r["profile"]], int(r["in_flight"]))
        halved.add_metric([r["profile"]], int(r["decreases"]))
    retained = GaugeMetricFamily(f"{NS}_replication_slot_retained_bytes", "WAL a logical "
                                 "replication slot of this database holds back: current LSN - "
                                 "restart_lsn (bytes). Grows while the Debezium relay is down.",
                                 labels=["slot"])
    slot_active = GaugeMetricFamily(f"{NS}_replication_slot_active", "1 when a walsender "
                                    "(the Debezium connector) streams from the slot.",
                                    labels=["slot"])
    for r in snap.get("replication_slots", []):
        retained.add_metric([r["slot"]], int(r["retained_bytes"]))
        slot_active.add_metric([r["slot"]], 1 if r["active"] else 0)
    stored = GaugeMetricFamily(f"{NS}_dead_letters_stored", "Dead letters kept in the Postgres "
                               "dead_letter table and not replayed (source: consumer or relay).",
                               labels=["source", "reason_code"])
    for r in snap.get("dead_letters", []):
        stored.add_metric([r["source"], r["reason_code"]], int(r["n"]))
    return [window, ceiling, holding, halved, retained, slot_active, stored,
            created, accepted, by_status, runs, retries, rate, takeovers, expired, attempts,
            in_flight, unknown, limited, cost, per_job, backlog, age,
            _histogram(f"{NS}_queue_wait_seconds", "Queue wait of stages finished in the "
                       "metrics window: previous checkpoint's finish -> this stage's claim "
                       "(seconds).", snap["queue_waits"]),
            _histogram(f"{NS}_stage_duration_seconds", "Run time of stages finished in the "
                       "metrics window: claim -> checkpoint (seconds).",
                       snap["stage_durations"]),
            _histogram(f"{NS}_provider_latency_seconds", "Latency of provider attempts "
                       "finished in the metrics window: request sent -> answer (seconds).",
                       snap.get("provider_latency", []), labels=("model_profile", "lane"))]


@dataclass
class GroupLag:
    """Lag of one consumer group: messages behind the high watermark, per topic."""

    group: str
    topics: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """Messages behind over every topic of the group."""
        return sum(self.topics.values())


class KafkaLag:
    """Consumer lag per group from Kafka: for every partition a group committed an offset
    in, or is assigned right now, ``high watermark - committed offset`` (an assigned
    partition with no committed offset counts from its low watermark: our consumers reset to
    ``earliest``).

    Groups: ``<prefix>jobstream-streams`` (the faust stage workers), the downstream
    consumers' groups (``metrics_downstream_groups``, prefixed), every other group named
    ``<prefix>jobstream-*`` the broker knows (e.g. the DLQ replay's), and
    ``metrics_consumer_groups``.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.timeout_s = settings.metrics_timeout_s
        self.admin = AdminClient(base_config(settings))

    def groups(self) -> list[str]:
        """The groups to report. Raises ``KafkaException``."""
        s = self.settings
        known = {s.group("jobstream-streams"), *map(s.group, s.metrics_downstream_groups),
                 *s.metrics_consumer_groups}
        listed = self.admin.list_consumer_groups(request_timeout=self.timeout_s).result(
            self.timeout_s + 1)
        prefix = s.group("jobstream-")
        return sorted(known | {g.group_id for g in listed.valid if g.group_id.startswith(prefix)})

    def _committed(self, group: str) -> dict[tuple[str, int], int]:
        futs = self.admin.list_consumer_group_offsets(
            [ConsumerGroupTopicPartitions(group)], request_timeout=self.timeout_s)
        try:
            res = futs[group].result(self.timeout_s + 1)
        except KafkaException:
            return {}  # e.g. the group does not exist (yet)
        return {(tp.topic, tp.partition): tp.offset for tp in res.topic_partitions or []
                if tp.error is None}

    def _assigned(self, groups: list[str]) -> dict[str, set[tuple[str, int]]]:
        out: dict[str, set[tuple[str, int]]] = {g: set() for g in groups}
        for group, fut in self.admin.describe_consumer_groups(
                groups, request_timeout=self.timeout_s).items():
            try:
                desc = fut.result(self.timeout_s + 1)
            except KafkaException:
                continue
            for m in desc.members or []:
                for tp in (m.assignment.topic_partitions if m.assignment else []) or []:
                    out[group].add((tp.topic, tp.partition))
        return out

    def _offsets(self, parts: set[tuple[str, int]], spec: OffsetSpec) -> dict[tuple[str, int],
                                                                             int]:
        if not parts:
            return {}
        futs = self.admin.list_offsets({TopicPartition(t, p): spec for t, p in parts},
                                       request_timeout=self.timeout_s)
        out = {}
        for tp, fut in futs.items():
            try:
                out[(tp.topic, tp.partition)] = fut.result(self.timeout_s + 1).offset
            except KafkaException:
                continue  # a deleted topic or a partition without a leader: no number
        return out

    def twins(self) -> dict[str, tuple[int, int]]:
        """Every ``.retry`` and ``.dlq`` twin (full name) -> ``(messages ever written,
        messages held now)``: the sums over partitions of the high watermark and of high - low.
        A twin that does not exist (yet) is left out. Raises ``KafkaException``."""
        from jobstream.kafka import CONSUMED_TOPICS, STAGE_TOPICS
        s = self.settings
        names = ([s.topic(f"{t}.retry") for t in STAGE_TOPICS]
                 + [s.topic(f"{t}.dlq") for t in CONSUMED_TOPICS])
        md = self.admin.list_topics(timeout=self.timeout_s).topics
        parts = {(t, p) for t in names if t in md and md[t].error is None
                 for p in md[t].partitions}
        hi = self._offsets(parts, OffsetSpec.latest())
        lo = self._offsets(parts, OffsetSpec.earliest())
        out: dict[str, tuple[int, int]] = {}
        for (t, p), h in sorted(hi.items()):
            produced, held = out.get(t, (0, 0))
            out[t] = (produced + h, held + max(h - lo.get((t, p), h), 0))
        return out

    def lag(self) -> list[GroupLag]:
        """The lag of every group (a group with no committed or assigned partition has an
        empty ``topics``). Raises ``KafkaException`` when the cluster does not answer."""
        groups = self.groups()
        committed = {g: self._committed(g) for g in groups}
        assigned = self._assigned(groups)
        parts = {tp for g in groups for tp in (*committed[g], *assigned[g])}
        latest = self._offsets(parts, OffsetSpec.latest())
        unset = {tp for g in groups for tp in assigned[g] if committed[g].get(tp, -1) < 0}
        earliest = self._offsets(unset, OffsetSpec.earliest())
        out = []
        for g in groups:
            gl = GroupLag(g)
            for tp in sorted(set(committed[g]) | assigned[g]):
                pos = committed[g].get(tp, -1)
                if pos < 0:
                    pos = earliest.get(tp, -1)
                if pos < 0 or tp not in latest:
                    continue
                gl.topics[tp[0]] = gl.topics.get(tp[0], 0) + max(latest[tp] - pos, 0)
            out.append(gl)
        return out


def kafka_families(lags: list[GroupLag],
                   twins: dict[str, tuple[int, int]] | None = None) -> list[Metric]:
    """``consumer_lag_messages{group,topic}`` and ``consumer_group_lag_messages{group}``; with
    ``twins`` (topic -> (messages ever written, messages held now), from
    :meth:`KafkaLag.twins`) also ``topic_produced_total{topic}`` and
    ``topic_retained_messages{topic}``."""
    per_topic = GaugeMetricFamily(f"{NS}_consumer_lag_messages", "Messages between a "
                                  "group's committed offset and the high watermark, per "
                                  "topic.", labels=["group", "topic"])
    per_group = GaugeMetricFamily(f"{NS}_consumer_group_lag_messages", "Messages a consumer "
                                  "group is behind, over its topics.", labels=["group"])
    for gl in lags:
        for topic, n in sorted(gl.topics.items()):
            per_topic.add_metric([gl.group, topic], n)
        if gl.topics:
            per_group.add_metric([gl.group], gl.total)
    produced = CounterMetricFamily(f"{NS}_topic_produced", "Messages ever written to a .retry "
                                   "or .dlq topic (sum of its high watermarks).",
                                   labels=["topic"])
    held = GaugeMetricFamily(f"{NS}_topic_retained_messages", "Messages a .retry or .dlq "
                             "topic holds now (high - low watermark).", labels=["topic"])
    for topic, (n_written, n_held) in sorted((twins or {}).items()):
        produced.add_metric([topic], n_written)
        held.add_metric([topic], n_held)
    return [per_topic, per_group, produced, held]


class JobstreamCollector(Collector):
    """A ``prometheus_client`` collector reading Postgres (``store``) and Kafka at scrape time.

    A source that fails (down, or slower than ``metrics_timeout_s``) is reported as
    ``jobstream_metrics_source_up{source=...} 0`` and its metrics are left out of that scrape;
    the other source's still are. One scrape's values are reused for ``metrics_cache_s``
    seconds (several Prometheus servers, one load).
    """

    def __init__(self, settings: Settings, store: Store, *,
                 kafka: KafkaLag | None = None) -> None:
        self.settings = settings
        self.store = store
        self._kafka = kafka
        self._lock = threading.Lock()
        self._cached: tuple[float, list[Metric]] | None = None

    def describe(self) -> list[Metric]:
        """Nothing: registering must not query Postgres or Kafka."""
        return []

    def collect(self) -> Iterator[Metric]:
        """The metric families of one (possibly cached) scrape."""
        with self._lock:
            now = time.monotonic()
            if self._cached is None or now - self._cached[0] >= self.settings.metrics_cache_s:
                self._cached = (now, self._scrape())
            return iter(self._cached[1])

    def _scrape(self) -> list[Metric]:
        s = self.settings
        up = GaugeMetricFamily(f"{NS}_metrics_source_up", "1 when the source answered this "
                               "scrape.", labels=["source"])
        took = GaugeMetricFamily(f"{NS}_metrics_source_duration_seconds", "Time to read the "
                                 "source (seconds).", labels=["source"])
        out: list[Metric] = []
        t0 = time.monotonic()
        try:
            snap = self.store.metrics_snapshot(window_s=s.metrics_window_s,
                                               bounds=list(BUCKETS_S),
                                               timeout_s=s.metrics_timeout_s)
            out += postgres_families(snap)
            up.add_metric(["postgres"], 1)
        except RetryableError as exc:
            log.warning("metrics: postgres unavailable: %s", exc)
            up.add_metric(["postgres"], 0)
        took.add_metric(["postgres"], time.monotonic() - t0)
        t0 = time.monotonic()
        try:
            if self._kafka is None:
                self._kafka = KafkaLag(s)
            out += kafka_families(self._kafka.lag(), self._kafka.twins())
            up.add_metric(["kafka"], 1)
        except (KafkaException, TimeoutError) as exc:
            log.warning("metrics: kafka unavailable: %s", exc)
            up.add_metric(["kafka"], 0)
        took.add_metric(["kafka"], time.monotonic() - t0)
        return [*out, up, took]


def registry(settings: Settings, store: Store) -> CollectorRegistry:
    """A registry holding only the jobstream collector (no process metrics: the numbers are
    the pipeline's, whichever process serves them)."""
    from jobstream.verify import VerifyCollector
    reg = CollectorRegistry(auto_describe=False)
    reg.register(JobstreamCollector(settings, store))
    reg.register(VerifyCollector(settings))  # jobstream_verify_broken{check}
    return reg


def serve(settings: Settings, host: str, port: int) -> int:
    """``jobstream metrics``: serve ``/metrics`` on ``host:port`` until SIGINT/SIGTERM;
    returns the exit code. Raises ``OSError`` when the port is taken."""
    from prometheus_client import start_http_server
    store = Store(settings.database_url, max_size=2)
    server, thread = start_http_server(port, addr=host, registry=registry(settings, store))
    log.info("metrics exporter on http://%s:%d/metrics", host, port)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    thread.join(5)
    store.close()
    return 0
