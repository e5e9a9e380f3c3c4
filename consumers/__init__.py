"""The jobstream consumer library: apply jobstream's events (``job.ready`` and friends)
exactly once in your own service.

Depends only on ``schemas`` (the event models), confluent-kafka, psycopg and pydantic-settings
(``pip install 'jobstream[consumer] @ git+<repository>'``: not on PyPI; the README says what
else that installs); nothing here imports ``jobstream``. See the README's
"Consume job.ready" section and ``examples/downstream_service/``.

Examples
--------
>>> from consumers import ConsumerSettings, IdempotentConsumer
>>> from schemas.events import JobReady
>>> consumer = IdempotentConsumer(ConsumerSettings())   # JOBSTREAM_CONSUMER_* from the env
>>> @consumer.on(JobReady)
... def apply(tx, event: JobReady) -> None:
...     tx.execute("INSERT INTO ledger (dedup_key, amount_usd) VALUES (%s, %s)",
...                (event.dedup_key, event.payload.charge_usd))
>>> consumer.create_tables()   # doctest: +SKIP
>>> consumer.run_forever()     # doctest: +SKIP
"""

from consumers.ddl import create_tables, ddl, key_digest, upgrade_tables
from consumers.idempotent import ConsumerStats, Hooks, IdempotentConsumer
from consumers.routing import DeadLetterSink, classify
from consumers.settings import ConsumerSettings
from schemas.errors import PoisonMessage, RetryableError

__all__ = ["ConsumerSettings", "ConsumerStats", "DeadLetterSink", "Hooks", "IdempotentConsumer",
           "PoisonMessage", "RetryableError", "classify", "create_tables", "ddl", "key_digest",
           "upgrade_tables"]
