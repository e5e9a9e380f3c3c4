"""Breaker10: a LIVE rebalance (a member joins; nobody loses its session) while a
``consume-ready`` holds messages fetched past its byte cap (``consumer_batch_max_bytes``:
the start of its next batch, kept in ``IdempotentConsumer._carry``) and a batch fetched
ahead, and is itself stuck inside a batch's apply.

The first member's apply waits on a lock the test holds (``SHARE`` on the analysis table: its
INSERT waits, ``active``, so no idle limit ends it), a second member joins meanwhile, and the
group's rebalance cannot finish until the first one polls again. Released, the first member
commits its batch and applies what it carried (the carry is taken before any poll, so before
it learns that its partitions moved) while the second member may already own and apply the
same positions. Whatever the interleaving: each event applied and charged once, each poison
position dead-lettered once, nothing in ``dead_letter``, lag 0 (:class:`Corpus` of
``test_break_consumer_batch_bytes``: the same big messages). Real processes, shared services.
"""

from __future__ import annotations

import psycopg
import pytest

from jobstream.settings import Settings
from tests.e2e.test_break_consumer_batch_bytes import ENV, Corpus
from tests.helpers import ProcessRunner, query, wait_for

pytestmark = pytest.mark.e2e


def _waiting_insert(url: str) -> list[dict[str, object]]:
    return query(url, "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                      "AND query ~ '^INSERT INTO downstream\\.document_analysis' "
                      "AND wait_event_type = 'Lock'")


def _group(settings: Settings) -> tuple[str, int]:
    """The ready applier's group: its state (describe_consumer_groups, e.g.
    PREPARING_REBALANCING) and how many of its members hold partitions."""
    from confluent_kafka.admin import AdminClient

    from jobstream.kafka import base_config
    admin = AdminClient(base_config(settings))  # referenced until the answer came
    (fut,) = admin.describe_consumer_groups([settings.group("downstream-ready-applier")],
                                            request_timeout=5).values()
    got = fut.result(10)
    return str(got.state.name), sum(1 for m in got.members
                                    if m.assignment and m.assignment.topic_partitions)


def test_a_live_rebalance_while_a_capped_batch_waits_doubles_nothing(
        settings: Settings, procs: ProcessRunner) -> None:
    url = settings.database_url
    corpus = Corpus(settings)
    with psycopg.connect(url) as holder:
        holder.execute("LOCK TABLE downstream.document_analysis IN SHARE MODE")
        first = procs.start("consume-ready", name="first", **ENV)
        wait_for(lambda: _waiting_insert(url), 60,
                 "the first member's apply to wait for the table lock", procs.logs)
        applied_before = corpus.applied()
        second = procs.start("consume-ready", name="second", **ENV)
        # the second member asked to join: the rebalance now waits for the first to poll
        wait_for(lambda: _group(settings)[0] == "PREPARING_REBALANCING", 60,
                 "the group to prepare a rebalance", procs.logs)
        wait_for(lambda: _waiting_insert(url), 5, "the first member still stuck", procs.logs)
        holder.commit()
    corpus.wait_done(procs)
    assert applied_before == 0, applied_before
    assert first.popen.poll() is None and second.popen.poll() is None, procs.logs()
    assert _group(settings) == ("STABLE", 2), "the rebalance did not split the partitions"
    corpus.check(max_copies=1)
