"""One settings object for every jobstream process.

Every field is bound to an environment variable ``JOBSTREAM_<FIELD>`` (pydantic-settings); the
two connection settings also accept the conventional ``DATABASE_URL`` and
``KAFKA_BOOTSTRAP_SERVERS``. librdkafka options pass through as a dotted-key dict in
``JOBSTREAM_KAFKA_EXTRA`` (JSON), e.g. ``{"socket.keepalive.enable": true}``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from functools import lru_cache
from typing import Any, Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

#: Where ``scripts/services.sh`` starts the project-local services.
DEFAULT_DATABASE_URL = "postgresql://jobstream:jobstream@127.0.0.1:55432/jobstream"
DEFAULT_KAFKA = "127.0.0.1:9092"
#: Room kept for a document.uploaded's envelope next to its base64 document (bytes).
INLINE_ENVELOPE_BYTES = 64 * 1024


class Settings(BaseSettings):
    """Typed configuration; see the field descriptions (units are in the names)."""

    model_config = SettingsConfigDict(env_prefix="JOBSTREAM_", extra="ignore",
                                      populate_by_name=True)

    database_dsn: SecretStr = Field(
        SecretStr(DEFAULT_DATABASE_URL),
        validation_alias=AliasChoices("JOBSTREAM_DATABASE_URL", "DATABASE_URL", "database_url"),
        description="libpq URL of the job store (it holds the password: a secret, never "
                    "printed; read it as ``settings.database_url``).",
    )
    kafka_bootstrap_servers: str = Field(
        DEFAULT_KAFKA,
        validation_alias=AliasChoices(
            "JOBSTREAM_KAFKA_BOOTSTRAP_SERVERS", "KAFKA_BOOTSTRAP_SERVERS"
        ),
        description="Comma-separated host:port list of Kafka brokers.",
    )
    kafka_extra: dict[str, Any] = Field(
        default_factory=dict, description="librdkafka options passed through verbatim."
    )
    topic_prefix: str = Field(
        "", description="Prefix for every topic and consumer group. It separates topics, not "
        "databases: one database is one deployment (its relay lock, outbox and sweeper serve "
        "every prefix), so give each prefix its own database.",
    )
    topic_partitions: int = Field(3, ge=1, description="Partitions per pipeline topic.")
    retry_topic_partitions: int = Field(
        1, ge=1, description="Partitions of each stage's .retry topic (a slow path: transient "
        "failures only). Every partition a worker is assigned is in every fetch it decodes, "
        "so fewer retry partitions cost less CPU per job (bench/README.md).",
    )
    topic_replication: int = Field(1, ge=1, description="Replication factor of created topics.")
    consumer_session_timeout_ms: int = Field(
        10_000, ge=1000, description="Kafka consumer session timeout (milliseconds)."
    )

    model_profile: str = Field(
        "local", description="Default model profile for new jobs: local, openai, ollama, vllm or "
                             "custom (jobstream/llm/profiles.py).")
    pipeline: str = Field("document-analysis", description="Default pipeline name.")
    prompt_version: str = Field("analysis-v1", description="Default prompt version.")
    provider_base_url: str | None = Field(
        None, description="Override the profile's OpenAI-compatible base URL (…/v1)."
    )
    provider_api_key: SecretStr | None = Field(
        None, description="Bearer key for the provider (a secret, never printed)."
    )
    provider_timeout_s: float = Field(60.0, gt=0, description="Per-request timeout (seconds).")
    provider_slot_margin_s: float = Field(
        30.0, gt=0, description="A slot of the shared provider limit lives provider_timeout_s "
        "+ this (seconds) when its holder never releases it (a worker killed or frozen mid-call); "
        "until then it counts against the window. The margin covers a live holder's own delays "
        "(Postgres, GC) between taking the slot and releasing it.",
    )
    provider_max_attempts: int = Field(
        3, ge=1, description="In-process attempts per provider call before the stage event "
                             "goes to the .retry topic."
    )
    provider_budget_attempts: int = Field(
        10, ge=1, description="Budget: provider attempts per chunk over all retry rounds."
    )
    job_deadline_s: float = Field(
        3600.0, gt=0, description="Budget: a job older than this fails instead of retrying "
                                  "the provider (seconds)."
    )
    retry_in_place: int = Field(
        2, ge=0, description="In-place retries of a transient failure before the .retry topic."
    )
    retry_rounds: int = Field(
        8, ge=1, description="Rounds through the .retry topic before the job fails."
    )
    retry_base_s: float = Field(1.0, ge=0, description="Retry-topic backoff base (seconds).")
    retry_cap_s: float = Field(300.0, ge=0, description="Retry-topic backoff cap (seconds).")
    provider_backoff_base_s: float = Field(0.5, ge=0, description="Backoff base (seconds).")
    provider_backoff_cap_s: float = Field(30.0, ge=0, description="Backoff cap (seconds).")

    charge_per_job_usd: float = Field(
        0.01, ge=0, le=999_999.99999999,
        description="What a client is charged per accepted job (USD; at most 999,999.99999999, "
        "what job.ready's charge_usd and the numeric(14, 8) columns hold)."
    )
    provider_deadline_s: float = Field(
        300.0, gt=0, description="Budget: wall time for one chunk's attempts (seconds)."
    )
    provider_cost_cap_usd: float = Field(
        1.0, ge=0, description="Budget: provider cost one job may spend (USD)."
    )
    outcome_unknown_policy: dict[str, str] = Field(
        default_factory=lambda: {"interactive": "retry", "batch": "reconcile"},
        description="Per lane, what a timed-out provider call does: retry, or park the job "
                    "in needs_reconciliation (jobstream reconcile).",
    )
    stage_code_versions: dict[str, str] = Field(
        default_factory=dict,
        description="Override a stage's code version (e.g. {\"validate\": \"validate-2\"}) to "
                    "make redrives recompute it and the stages after it.",
    )
    stage_one_transaction: bool = Field(
        True,
        description="Short pure stages (extract of text/plain, chunk, validate, publish) claim, "
                    "work and complete in ONE transaction under the job's row lock instead of "
                    "a claim transaction and a completion transaction (bench/README.md).",
    )
    stage_concurrency: int = Field(
        8, ge=1, description="Events one worker's agent of extract, chunk, validate or "
        "publish holds at once when stage_batch_max > 1: while one shared transaction "
        "commits, the next one gathers. Events that cannot share one (a PDF) still run one "
        "at a time.",
    )
    stage_batch_max: int = Field(
        16, ge=1, description="One-transaction stages (extract of text/plain, chunk, "
        "validate, publish): most events that share one transaction (group commit: those "
        "that arrived while the previous one committed; each still fenced by its own run "
        "token and generation, in its own savepoint). 1: a transaction per event.",
    )
    max_stage_attempts: int = Field(
        5, ge=1, description="Runs of one stage before the sweeper fails a stuck job."
    )
    sweep_grace_s: float = Field(
        300.0, ge=0, description="Sweeper: re-drive stages whose lease expired this long ago "
        "(seconds). Kafka redelivery recovers a crashed run within a session timeout plus a "
        "lease; the sweeper is the backstop for runs nothing will redeliver."
    )
    sweep_stall_grace_s: float = Field(
        300.0, ge=0, description="Sweeper backstop for a lost stage event: a job whose last "
        "checkpoint succeeded this long ago (seconds, times 2 ** its sweeps), whose next stage "
        "was never claimed and which has no row waiting in the outbox gets the next stage's "
        "event re-emitted through the outbox (a duplicate is skipped by the idempotent "
        "consumer). Keep it above the longest consumer lag you expect (docs/design-notes.md).",
    )
    llm_local_one_transaction: bool = Field(
        True, description="The llm stage of a job on the in-process model (local profile) "
        "claims, answers and completes in ONE transaction, shared with other events like the "
        "short stages (stage_batch_max); a remote provider's job keeps two transactions, its "
        "lease and the shared limit whatever this says (bench/README.md).",
    )
    llm_concurrency: int = Field(
        4, ge=1, description="Chunk-stage events one worker's LLM agent runs at once."
    )
    intake_batch_max: int = Field(
        100, ge=1, description="document.uploaded events one worker's intake agent takes at "
        "once and accepts in ONE Postgres transaction (a savepoint per intent; "
        "streams/intake.py). 1: a transaction per event.",
    )
    intake_batch_wait_s: float = Field(
        0.0, ge=0, description="How long the first event of an intake batch waits for "
        "others before the batch commits (seconds); events that arrive while a batch commits "
        "form the next one without waiting. 0 (group commit): a batch starts at once with "
        "what has arrived, so a lone document is not held back (bench/README.md, Latency).",
    )
    intake_batch_max_bytes: int = Field(
        16 * 1024 * 1024, ge=1, description="An intake batch is cut once its documents' "
        "declared sizes reach this many bytes (one document alone may be larger).",
    )
    provider_max_concurrency: int = Field(
        8, ge=1, description="Provider calls in flight over ALL workers and both lanes, per "
                             "remote profile: the AIMD limit's ceiling."
    )
    provider_interactive_reserved: int = Field(
        1, ge=0, description="Slots of the shared limit that batch work may never take."
    )
    chunk_size_chars: int = Field(4000, ge=200, description="Target chunk size (characters).")
    lease_s: float = Field(120.0, gt=0, description="Stage lease length (seconds).")
    lease_heartbeat_s: float | None = Field(
        None, gt=0, description="While a provider call or a Retry-After wait is in progress "
        "the run renews its lease this often (seconds); unset: lease_s / 4. Must stay below "
        "lease_s / 3, so two missed heartbeats never lose the lease."
    )
    document_roots: list[str] = Field(
        default_factory=list,
        description="Directories a document.uploaded may name with a file:// URI (JSON list). "
                    "Empty: file:// URIs are refused, so an event cannot make a worker read "
                    "an arbitrary file.",
    )
    max_inline_document_bytes: int = Field(
        5 * 1024 * 1024, ge=1, description="Largest document accepted (bytes): checked on "
        "the declared size_bytes and on the bytes actually read (inline or file://)."
    )
    extract_timeout_s: float = Field(
        60.0, gt=0, description="Extraction: wall time one PDF may take; the extractor "
                                "process is killed after it (seconds)."
    )
    extract_max_pages: int = Field(1000, ge=1, description="Extraction: most PDF pages.")
    extract_max_text_chars: int = Field(
        2_000_000, ge=1, description="Extraction: most characters of extracted text."
    )
    extract_max_stream_bytes: int = Field(
        32 * 1024 * 1024, ge=1024,
        description="Extraction: bytes one PDF stream may inflate to (decompression bombs).",
    )
    extract_max_memory_bytes: int = Field(
        1024 * 1024 * 1024, ge=256 * 1024 * 1024,
        description="Extraction: address space of the PDF extractor process (bytes).",
    )

    kafka_message_max_bytes: int = Field(
        8 * 1024 * 1024, ge=10_000,
        description="Largest message (bytes) jobstream produces or accepts: the producers' "
                    "message.max.bytes, the pipeline topics' max.message.bytes (jobstream "
                    "topics) and the consumers' bound before decoding (larger: DLQ "
                    "message_too_large). DLQ topics get this plus dlq_headroom_bytes. Must fit "
                    "max_inline_document_bytes as base64 in a document.uploaded.",
    )
    dlq_headroom_bytes: int = Field(
        64 * 1024, ge=4096,
        description="What a DLQ message may carry beyond its original (the dlq_* headers), "
                    "bytes: the DLQ topics' max.message.bytes is kafka_message_max_bytes + this.",
    )
    max_json_depth: int = Field(
        64, ge=4, description="Deepest JSON nesting a consumer parses; deeper values are "
                              "dead-lettered (json_too_deep) before the parser sees them."
    )
    dlq_produce_timeout_s: float = Field(
        10.0, gt=0, description="A dead letter not acknowledged by <topic>.dlq within this "
                                "long is kept in the Postgres dead_letter table (seconds)."
    )
    consumer_batch_max_bytes: int = Field(
        64 * 1024 * 1024, ge=1024, le=512 * 1024 * 1024,
        description="Idempotent consumer (consume-ready): most bytes (keys + values) of "
                    "messages applied in one transaction; a single larger message is applied "
                    "alone (consumers.ConsumerSettings.batch_max_bytes).",
    )
    consumer_poison_after: int = Field(
        5, ge=1, description="Idempotent consumer: the same handler error on the same message "
                             "this many times makes it poison (dead-lettered, partition moves on)."
    )
    relay_backoff_cap_s: float = Field(
        30.0, gt=0, description="Relay: longest wait before re-sending rows whose delivery "
                                "failed with a retriable error (seconds; doubles from 0.5)."
    )
    relay_topic_limit_refresh_s: float = Field(
        60.0, gt=0, description="Relay: a topic's max.message.bytes, once known, is asked "
                                "again after this long (seconds): a topic whose limit was "
                                "lowered below the producer's goes in record batches under "
                                "its limit from then on, a larger row alone (per-key order "
                                "when the broker refuses a large row).")
    relay_missing_topic_park_s: float = Field(
        300.0, ge=0, description="Relay: rows for a topic the broker says does not exist (never "
                                 "created, or deleted) are retried this long after the relay "
                                 "first saw it missing, then parked in the dead_letter table "
                                 "(undeliverable; their jobs fail) so they stop holding up the "
                                 "outbox (seconds; 0 parks at the first failure)."
    )
    relay_topic_propagation_ms: int = Field(
        3000, ge=0, description="Relay: the producers' topic.metadata.propagation.max.ms "
                                "(milliseconds): how long the first row to a topic the broker "
                                "does not know waits in the client before it fails as missing "
                                "(librdkafka's default 30000). Its rows are held and re-sent "
                                "anyway (relay_missing_topic_park_s), so a short wait costs "
                                "nothing; a topic created later is found on the re-send. "
                                "JOBSTREAM_KAFKA_EXTRA's value, if any, wins."
    )
    relay_batch_size: int = Field(500, ge=1, description="Outbox rows per relay batch.")
    relay_linger_ms: float = Field(
        0.0, ge=0, description="Relay: the producer's linger.ms (milliseconds), how long a row "
                               "waits for others to share its produce request. Caught up, every "
                               "hop of a job waited it (5 ms, producer_config's, before issue "
                               "12's latency part: bench/README.md, Latency); draining a "
                               "backlog, rows queue behind the requests in flight anyway."
    )
    relay_max_in_flight: int = Field(
        5000, ge=1, description="Relay: most rows produced and not yet acknowledged; the next "
                                "batch is fetched while earlier ones are in flight."
    )
    relay_in_flight_wait_s: float = Field(
        0.005, gt=0, description="Relay, caught up with rows in flight: how long it waits for "
                                 "a NOTIFY before marking the acknowledged rows (seconds)."
    )
    relay_rescan_s: float = Field(
        1.0, gt=0, description="Relay, draining a backlog: how often it also looks below its "
                               "last id for rows of transactions that committed late (seconds)."
    )
    relay_late_commit_s: float = Field(
        5.0, gt=0, description="Relay: a transaction that wrote an outbox row commits within "
                               "this long (seconds); the relay's floor trails by as much. A "
                               "longer one's rows wait for the next full rescan."
    )
    relay_full_rescan_s: float = Field(
        60.0, gt=0, description="Relay: how often it reads the outbox from id 0 (seconds): "
                                "the bound for rows of transactions open longer than "
                                "relay_late_commit_s."
    )
    relay_delete_hold_s: float = Field(
        0.02, gt=0, description="Relay, caught up: how long acknowledged rows wait for the "
                                "next commit's NOTIFY, whose fetch deletes them in the same "
                                "statement (one transaction), before they are deleted alone "
                                "(seconds). Publishing is not delayed by it."
    )
    relay_published_log: bool = Field(
        True, description="Relay: keep a compact outbox_published row (id, event id and type, "
                          "key, created and published times) of each row it deletes once "
                          "published; `jobstream verify`, the chaos drill's invariants and "
                          "bench.pipeline's relay hop read it (migration 0022)."
    )
    relay_poll_interval_s: float = Field(
        1.0, gt=0, description="Relay polling fallback when no NOTIFY arrives (seconds)."
    )
    outbox_notify: Literal["after_commit", "in_transaction"] = Field(
        "after_commit", description="How jobstream's processes wake the relay for the outbox "
                                    "rows they commit: after_commit (a NOTIFY after the commit, "
                                    "in a transaction of its own committed asynchronously; a "
                                    "writer killed in between leaves its rows to the relay's "
                                    "poll) or in_transaction (the outbox trigger's NOTIFY in "
                                    "the writing transaction, which serialises notifying "
                                    "commits server-wide through their WAL flush; migration "
                                    "0039, bench/README.md relay ninth pass)."
    )
    relay_lock_timeout_s: float = Field(
        120.0, ge=3, description="Relay: Postgres ends the active relay's lock session after "
                                 "this long without a statement (idle_session_timeout; the "
                                 "relay runs one at least every third of it) or with an "
                                 "answer left unread (tcp_user_timeout, Linux), so a relay "
                                 "frozen (SIGSTOP, VM pause) longer loses its lock and a "
                                 "standby takes over (seconds; keep it above the 60 s a "
                                 "delivery flush may take)."
    )
    outbox_retention_s: float = Field(
        7 * 24 * 3600.0, ge=0, description="Retention: published outbox rows are deleted this "
                                           "long after they were published (seconds)."
    )
    processed_event_retention_s: float = Field(
        35 * 24 * 3600.0, ge=0,
        description="Retention: idempotent-consumer rows (processed_event) are deleted this long "
                    "after the event was processed (seconds). Must exceed the redelivery "
                    "window 2 x retention.ms(topic) + retention.ms(.retry) + retention.ms(.dlq) "
                    "(28 days with Kafka's default 7); gc checks it and keeps the rows "
                    "otherwise.",
    )
    idempotency_retention_s: float = Field(
        30 * 24 * 3600.0, ge=0,
        description="Retention: idempotency records (job_request) of finished jobs are deleted "
                    "this long after the job finished and the record was written (seconds): "
                    "how long a client's Idempotency-Key stays bound to its request body.",
    )
    gc_interval_s: float = Field(
        300.0, gt=0, description="The active relay runs retention (gc) this often (seconds)."
    )
    relay: Literal["python", "debezium"] = Field(
        "python", description="What publishes the outbox: the Python relay (`jobstream relay`) "
                              "or Debezium on Kafka Connect (`jobstream connect deploy`).",
    )
    connect_url: str = Field(
        "http://127.0.0.1:8083", description="Kafka Connect REST API (the Debezium relay)."
    )
    connect_connector_name: str = Field(
        "", description="Name of the Debezium outbox connector (default: "
                        "jobstream-outbox-<database name>)."
    )
    replication_slot: str = Field(
        "", description="Logical replication slot of the Debezium relay; slot names are "
                        "cluster-wide (default: jobstream_<database name>)."
    )
    publication: str = Field(
        "jobstream_outbox", description="Publication the Debezium relay reads: the outbox "
                                        "table only."
    )
    connect_heartbeat_s: float = Field(
        10.0, gt=0, description="The Debezium connector touches relay_heartbeat this often, so "
                                "its slot advances on a quiet database (seconds)."
    )
    slot_retained_alert_bytes: int = Field(
        1024 ** 3, ge=0, description="jobstream verify flags a replication slot retaining more "
                                     "WAL than this (bytes)."
    )
    gc_batch_size: int = Field(
        5000, ge=1, description="Retention deletes at most this many rows per transaction."
    )
    log_format: Literal["text", "json"] = Field(
        "text", description="Log format of every process: text (human) or json (one object "
                            "per line, with request_id, job_id, tenant, stage, trace_id)."
    )
    metrics_window_s: float = Field(
        3600.0, gt=0, description="Metrics: queue-wait and stage-duration histograms cover "
                                  "stages finished this recently (seconds)."
    )
    metrics_cache_s: float = Field(
        5.0, ge=0, description="Metrics: reuse one scrape's values for this long (seconds)."
    )
    metrics_timeout_s: float = Field(
        5.0, gt=0, description="Metrics: bound on each Postgres statement and Kafka request "
                               "of a scrape (seconds)."
    )
    metrics_consumer_groups: list[str] = Field(
        default_factory=list,
        description="Metrics: more consumer groups (full names) to report lag for, besides "
                    "the prefixed jobstream-* groups and metrics_downstream_groups (JSON list).",
    )
    metrics_downstream_groups: list[str] = Field(
        default_factory=lambda: ["downstream-ready-applier"],
        description="Metrics: consumer groups of job.ready consumers to report lag for, "
                    "logical names taking JOBSTREAM_TOPIC_PREFIX like jobstream's own (JSON "
                    "list; default: `jobstream consume-ready`).",
    )

    db_pool_worker_max: int = Field(
        8, ge=1, description="Connection budget: Postgres connections one stage worker's pool "
                             "may open (stage transactions are short; extra callers wait)."
    )
    db_pool_api_max: int = Field(
        8, ge=1, description="Connection budget: Postgres connections of the API's pool."
    )
    db_pool_relay_max: int = Field(
        2, ge=1, description="Connection budget: the relay's pool for the sweeper and "
                             "retention (besides its one connection holding the relay lock)."
    )
    db_pool_min_size: int = Field(
        0, ge=0, description="Connections every pool keeps open even when idle."
    )
    db_pool_max_idle_s: float = Field(
        30.0, gt=0, description="A pooled connection idle this long is closed (seconds), so "
                                "an idle process gives its connections back."
    )
    db_pool_timeout_s: float = Field(
        30.0, gt=0, description="Longest wait for a pooled connection before the operation "
                                "fails as retryable (seconds)."
    )
    db_pool_check_idle_s: float = Field(
        1.0, ge=0, description="A pooled connection is checked (one empty round trip) before "
                               "it is handed out only when it sat idle longer than this "
                               "(seconds; 0: always). A busy process reuses connections "
                               "within milliseconds: checking each would cost a round trip "
                               "and a Postgres transaction per store call; one that broke "
                               "while in use fails its operation as retryable."
    )
    db_prepare_threshold: int | None = Field(
        0, ge=0, description="Executions of a statement on one pooled connection before "
                             "psycopg prepares it server-side (psycopg's prepare_threshold; "
                             "0: at once, None: never). psycopg's default, 5, had every new "
                             "pooled connection parse and plan each stage statement five "
                             "times before it was prepared (issue 12, bench/README.md "
                             "\"Postgres and the broker per job\")."
    )
    db_worker_plan_cache_mode: Literal["auto", "force_generic_plan", "force_custom_plan"] = Field(
        "force_generic_plan",
        description="Postgres plan_cache_mode of the stage workers' pooled connections. "
                    "force_generic_plan: a prepared statement is planned once per connection "
                    "(Postgres' auto makes five custom plans first, and keeps planning every "
                    "execution when it estimates the generic plan dearer); every statement "
                    "a worker runs is a keyed lookup or an unnest insert, whose plan does not "
                    "depend on the values (issue 12, bench/README.md \"Stage workers, "
                    "perf-stage6\"). The sweeper (in the relay) keeps auto.")
    health_port: int = Field(
        0, ge=0, le=65535, description="Serve GET /healthz (readiness) on this port in worker, "
                                       "relay and consume-ready (0: off; the API uses its own).")
    health_host: str = Field("127.0.0.1", description="Address of the /healthz endpoint.")
    health_fail_after_s: float = Field(
        10.0, gt=0, description="Readiness turns unhealthy after this long without a database "
                                "connection (seconds)."
    )
    health_probe_interval_s: float = Field(
        2.0, gt=0, description="An idle process probes the database this often (seconds)."
    )

    verify_grace_s: float = Field(
        300.0, ge=0, description="jobstream verify: how long a job may make no progress, a "
        "succeeded stage wait for its next stage, or a succeeded job wait for its downstream "
        "before it counts as broken (seconds)."
    )
    verify_outbox_age_s: float = Field(
        60.0, ge=0, description="jobstream verify: oldest tolerated unpublished outbox row "
                                "(seconds)."
    )
    verify_max_lag: int = Field(
        10_000, ge=0, description="jobstream verify: most messages a consumer group may be "
                                  "behind."
    )
    verify_downstreams: list[str] = Field(
        default_factory=lambda: ["ready-applier"],
        description="jobstream verify: downstream plug-ins whose effects are checked (JSON "
                    "list; jobstream.verify.DOWNSTREAMS).",
    )
    verify_interval_s: float = Field(
        60.0, gt=0, description="/metrics runs jobstream verify at most this often for the "
                                "jobstream_verify_* gauges (seconds)."
    )

    api_tokens: dict[SecretStr, str] = Field(
        default_factory=dict,
        description="HTTP API bearer tokens -> tenant id (JSON object). The tenant always comes "
                    "from the token, never from the request body. Secrets: never printed.",
    )
    api_allow_dev_tokens: bool = Field(
        False, description="Let the API start with a placeholder token (change-me, empty): "
                           "for local development only."
    )
    api_max_body_bytes: int = Field(
        20 * 1024 * 1024, ge=1024, description="API: largest request body, enforced while "
                                               "reading, before parsing (bytes; 413)."
    )
    api_max_batch_bytes: int = Field(
        12 * 1024 * 1024, ge=1, description="API: most document bytes in one batch, summed "
                                            "over its documents (bytes; 413)."
    )
    api_emit_uploaded: bool = Field(
        False, description="The API also writes document.uploaded to the outbox for others."
    )
    sse_keepalive_s: float = Field(
        15.0, gt=0, description="Server-Sent Events: a keep-alive comment after this many "
                                "seconds without an event (seconds; proxies cut idle streams)."
    )

    @field_validator("model_profile")
    @classmethod
    def _known_profile(cls, v: str) -> str:
        from jobstream.llm.profiles import PROFILES
        if v not in PROFILES:
            raise ValueError(f"unknown model profile {v!r}; known: {', '.join(PROFILES)}")
        return v

    @model_validator(mode="after")
    def _lease_outlives_heartbeats(self) -> Settings:
        """A lease must survive missed heartbeats: lease_s > 3 x lease_heartbeat_s."""
        if self.lease_heartbeat_s is not None and self.lease_s <= 3 * self.lease_heartbeat_s:
            raise ValueError(
                f"JOBSTREAM_LEASE_S={self.lease_s:g} must exceed 3 x "
                f"JOBSTREAM_LEASE_HEARTBEAT_S={self.lease_heartbeat_s:g} (a run renews its "
                "lease every heartbeat; a lease shorter than three heartbeats expires under a "
                "live run and the stage is taken over). Raise the lease or shorten the "
                "heartbeat.")
        return self

    @model_validator(mode="after")
    def _known_stage_code_versions(self) -> Settings:
        """``stage_code_versions`` names stages of the pipeline; a name from before migration
        0019 (``validated``...) is mapped to the stage's name with a warning."""
        from schemas.pipeline import OLD_NAMES, PIPELINE
        versions = {}
        for name, version in self.stage_code_versions.items():
            if name in OLD_NAMES:
                logging.getLogger("jobstream.settings").warning(
                    "JOBSTREAM_STAGE_CODE_VERSIONS: stage name %r is deprecated; use %r",
                    name, OLD_NAMES[name])
                name = OLD_NAMES[name]
            if name not in PIPELINE.names:
                raise ValueError(f"JOBSTREAM_STAGE_CODE_VERSIONS names an unknown stage "
                                 f"{name!r}; stages: {', '.join(PIPELINE.names)}")
            versions[name] = version
        self.stage_code_versions = versions
        return self

    @property
    def heartbeat_s(self) -> float:
        """The lease heartbeat in force (seconds): ``lease_heartbeat_s`` or ``lease_s / 4``."""
        return self.lease_heartbeat_s or self.lease_s / 4

    @model_validator(mode="after")
    def _limits_agree(self) -> Settings:
        """The largest inline document, base64 in a document.uploaded, fits a Kafka message."""
        inline_b64 = 4 * -(-self.max_inline_document_bytes // 3)
        if inline_b64 + INLINE_ENVELOPE_BYTES > self.kafka_message_max_bytes:
            raise ValueError(
                f"max_inline_document_bytes={self.max_inline_document_bytes} is "
                f"{inline_b64} bytes as base64, over kafka_message_max_bytes="
                f"{self.kafka_message_max_bytes} minus {INLINE_ENVELOPE_BYTES} for the "
                "envelope: raise kafka_message_max_bytes or lower the inline limit")
        return self

    @property
    def database_url(self) -> str:
        """The libpq URL of the job store, password included (do not log it)."""
        return self.database_dsn.get_secret_value()

    def model_copy(self, *, update: Mapping[str, Any] | None = None,
                   deep: bool = False) -> Settings:
        """A copy with ``update`` applied; ``database_url`` is accepted for ``database_dsn``."""
        if update and "database_url" in update:
            update = {**update, "database_dsn": SecretStr(str(update["database_url"]))}
            del update["database_url"]
        return super().model_copy(update=update, deep=deep)

    def public_dump(self) -> dict[str, Any]:
        """Every setting with secrets masked (``**********``): what ``jobstream config``
        prints and what may be logged."""
        out = {}
        for name, value in self.model_dump().items():
            if isinstance(value, dict):
                value = {(f"**********({i})" if isinstance(k, SecretStr) else k): v
                         for i, (k, v) in enumerate(value.items(), 1)}
            elif name == "database_dsn":
                value = masked_database_url(self.database_url)
            elif isinstance(value, SecretStr):
                value = "**********"
            out[name] = value
        return out

    def to_env(self) -> dict[str, str]:
        """``JOBSTREAM_*`` environment variables that carry these settings, secrets included,
        to a child process (never print them: :meth:`public_dump` is for that)."""
        env: dict[str, str] = {}
        for name in type(self).model_fields:
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, SecretStr):
                value = value.get_secret_value()
            elif isinstance(value, dict):
                value = {(k.get_secret_value() if isinstance(k, SecretStr) else k): v
                         for k, v in value.items()}
            key = ("JOBSTREAM_DATABASE_URL" if name == "database_dsn"
                   else f"JOBSTREAM_{name.upper()}")
            env[key] = json.dumps(value) if isinstance(value, dict | list) else str(value)
        return env

    def topic(self, name: str) -> str:
        """Full topic name for a logical topic ``name`` (adds :attr:`topic_prefix`)."""
        return f"{self.topic_prefix}{name}"

    def group(self, name: str) -> str:
        """Full consumer-group id for a logical group ``name``."""
        return f"{self.topic_prefix}{name}"


@lru_cache(maxsize=1)
def masked_database_url(url: str) -> str:
    """``url`` (a libpq URL or ``key=value`` string) as ``postgresql://user:**********@host:port
    /dbname``: which database, never its password (nor any other parameter, which may hold
    one). An unparseable value is masked whole (``**********``)."""
    from psycopg.conninfo import conninfo_to_dict
    try:
        d = conninfo_to_dict(url)
    except Exception:  # noqa: BLE001 - whatever libpq refuses, print nothing of it
        return "**********"
    user = f"{d.get('user', '')}:**********@" if d.get("password") else (
        f"{d['user']}@" if d.get("user") else "")
    port = f":{d['port']}" if d.get("port") else ""
    return f"postgresql://{user}{d.get('host', '')}{port}/{d.get('dbname', '')}"


def get_settings() -> Settings:
    """The process-wide settings, read once from the environment."""
    return Settings()
