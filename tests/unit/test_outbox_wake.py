"""The post-commit wake-up's bookkeeping (issue 12, perf-notify9): every named query that
inserts outbox rows from a Store transaction marks its connection, so a new one cannot be
added without waking the relay (its rows would wait for the relay's poll)."""

from __future__ import annotations

import re

import pytest

from jobstream.db import QUERIES
from jobstream.store import OUTBOX_WRITES, outbox_notify_option

#: Outbox inserts that never run in a Store's transaction: the Debezium hand-over (its own
#: connection, no relay to wake).
NOT_STORE = {"debezium_handover"}


def test_every_query_inserting_outbox_rows_is_a_marked_store_write() -> None:
    inserting = {name for name, sql in QUERIES.items()
                 if re.search(r"\bINSERT\s+INTO\s+outbox\s*\(", sql, re.I)}
    assert inserting - NOT_STORE == OUTBOX_WRITES


def test_the_session_option_per_mode() -> None:
    assert outbox_notify_option("after_commit") == "-c jobstream.outbox_notify=after_commit"
    assert outbox_notify_option("in_transaction") == ""
    with pytest.raises(ValueError, match="outbox_notify"):
        outbox_notify_option("after")
