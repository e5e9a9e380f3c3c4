"""A member of a second consumer group on ``job.ready`` for
``test_break_two_groups_dead_letters.py`` (run by :class:`tests.helpers.ScriptRig`): the consumer
library, no effect but its ``processed_event`` row, logging at INFO on stdout.

argv: bootstrap servers, database URL, topic prefix, consumer group, schema (its tables made
by the test). Environment ``FREEZE`` says where the process stops itself (SIGSTOP, the way
fault points do; the test resumes it with SIGCONT):

- ``apply``: in its 5th handler call, inside a batch's apply transaction (the batch's dead
  letters not sent yet);
- ``between``: right after its first dead letter is durable (the DLQ acknowledged it and its
  marker row committed) and before the next dead letter of the batch begins;
- anything else: no freeze.

It prints ``FREEZING <point>`` before it stops.
"""

import logging
import os
import signal
import sys

from consumers import ConsumerSettings, IdempotentConsumer
from schemas.events import JobReady

logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                    format="%(asctime)s %(levelname)s %(name)s: %(message)s")
boot, dsn, prefix, group, schema = sys.argv[1:6]
point = os.environ.get("FREEZE", "")
calls = {"apply": 0, "between": 0}


def freeze(where: str, at: int) -> None:
    """Stop this process at the ``at``-th call for ``where`` when ``FREEZE`` names it."""
    calls[where] += 1
    if point == where and calls[where] == at:
        print("FREEZING", where, flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)


consumer = IdempotentConsumer(
    ConsumerSettings(bootstrap_servers=boot, dsn=dsn, group=group, db_schema=schema,
                     topic_prefix=prefix, batch_size=100, session_timeout_ms=6000,
                     transaction_idle_timeout_s=3, dlq_produce_timeout_s=5),
    on_dead_lettered=lambda code, reason: freeze("between", 1))


@consumer.on(JobReady)
def apply(tx: object, event: JobReady) -> None:
    freeze("apply", 5)


print("STARTED", flush=True)
consumer.run()
