"""The consumer library's own settings (environment prefix ``JOBSTREAM_CONSUMER_``)."""

from __future__ import annotations

from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class ConsumerSettings(BaseSettings):
    """Settings of one :class:`~consumers.idempotent.IdempotentConsumer`.

    Read from the environment with the prefix ``JOBSTREAM_CONSUMER_`` (e.g.
    ``JOBSTREAM_CONSUMER_DSN``, ``JOBSTREAM_CONSUMER_GROUP``); arguments win.

    Examples
    --------
    >>> s = ConsumerSettings(group="billing", dsn="postgresql://u:p@db/billing",
    ...                      bootstrap_servers="127.0.0.1:9092", db_schema="billing")
    >>> s.topic("job.ready")
    'job.ready'
    """

    model_config = SettingsConfigDict(env_prefix="JOBSTREAM_CONSUMER_", extra="ignore")

    bootstrap_servers: str = Field("127.0.0.1:9092",
                                   description="Comma-separated host:port list of Kafka brokers.")
    group: str = Field("downstream", min_length=1,
                       description="Kafka consumer group, also the dedup namespace in the table.")
    dsn: str = Field("postgresql://localhost/postgres",
                     description="Postgres connection string (the effects' database).")
    db_schema: str = Field("public",
                           description="Schema of the processed_event and dead_letter tables "
                                       "('' = unqualified names, found on the search_path).")
    table: str = Field("processed_event", min_length=1,
                       description="Name of the idempotent-consumer (dedup) table.")
    dead_letter_table: str = Field("dead_letter", min_length=1,
                                   description="Name of the dead-letter fallback table.")
    topic_prefix: str = Field("", description="Prefix of every topic name (e.g. per tenant).")
    batch_size: int = Field(2000, ge=1, description="Most messages applied in one transaction.")
    batch_max_bytes: int = Field(
        64 * 1024 * 1024, ge=1024, le=512 * 1024 * 1024,
        description="Most bytes (message keys + values) applied in one transaction: a fetched "
                    "batch stops before the message that would take it over this, and that "
                    "message starts the next batch. Bounds the batch handler's parameters "
                    "(one Bind message: Postgres refuses one over 1 GB, hence at most "
                    "512 MiB) and the batch's "
                    "memory. A single message larger than this is applied alone (its own "
                    "transaction, the per-event handler), never skipped.")
    apply_lanes: int = Field(
        2, ge=1, le=16,
        description="Postgres connections applying one fetched batch: its messages are split "
                    "by partition (partition % apply_lanes) and the parts are applied "
                    "concurrently, each in its own transaction on its own connection, so one "
                    "part's Python work runs while another waits on Postgres. A partition's "
                    "messages always stay in one part (per-partition order kept); the next "
                    "batch starts when every part is committed; offsets are stored only after "
                    "their part's commit. 1 = the whole batch in one transaction.")
    apply_lanes_min_batch: int = Field(
        200, ge=2,
        description="Smallest fetched batch split into apply lanes (messages): a smaller one "
                    "(a live stream with little lag) is applied in one transaction, so it "
                    "does not pay an extra commit to overlap a short wait.")
    decode_ahead: bool = Field(True, description="Fetch and decode the next batch in a second "
                                                 "thread while one is applied in Postgres.")
    gc_tuning: bool = Field(True, description="While run() runs: gc.freeze() the objects alive "
                                              "at its start and collect young cycles every "
                                              "50,000 allocations, not 700 (the collector "
                                              "doubled the decode cost of a batch). Restored "
                                              "when run() returns.")
    switch_interval_s: float | None = Field(
        0.0005, gt=0, le=0.1,
        description="While run() runs with decode_ahead: sys.setswitchinterval(this) (seconds; "
                    "Python's default is 0.005), so the applying thread gets the GIL back "
                    "within this long of a Postgres reply while the decode thread runs, "
                    "instead of up to 5 ms per round trip. Process-wide; restored when run() "
                    "returns. None leaves it alone.")
    poison_after: int = Field(5, ge=1, description="The same handler error on the same message "
                                                   "this many times makes it poison (DLQ).")
    max_message_bytes: int = Field(8 * 1024 * 1024, ge=10_000,
                                   description="Largest message value decoded (bytes); larger "
                                               "is poison (message_too_large).")
    max_json_depth: int = Field(64, ge=4, description="Deepest JSON nesting decoded; deeper is "
                                                      "poison (json_too_deep).")
    dlq_produce_timeout_s: float = Field(10.0, gt=0,
                                         description="A dead letter <topic>.dlq has not "
                                                     "acknowledged within this long (seconds) "
                                                     "goes to the dead_letter table.")
    dlq_headroom_bytes: int = Field(64 * 1024, ge=4096,
                                    description="Room for dlq_* headers above "
                                                "max_message_bytes (bytes).")
    session_timeout_ms: int = Field(10_000, ge=1000,
                                    description="Kafka consumer session timeout (ms).")
    transaction_idle_timeout_s: float = Field(
        60.0, gt=0, description="Postgres ends the consumer's session when its transaction "
                                "sits idle this long (idle_in_transaction_session_timeout, "
                                "seconds): a consumer frozen mid-batch (SIGSTOP, VM pause) "
                                "then no longer holds the batch's processed_event rows, which "
                                "the partitions' next owner waits for. A dead letter's "
                                "transaction, which waits for the DLQ, gets at least "
                                "2 x (dlq_produce_timeout_s + 5) + 10 s.")
    kafka_extra: dict[str, Any] = Field(default_factory=dict,
                                        description="librdkafka options passed verbatim.")

    def topic(self, name: str) -> str:
        """Full topic name of logical topic ``name`` (adds :attr:`topic_prefix`)."""
        return f"{self.topic_prefix}{name}"
