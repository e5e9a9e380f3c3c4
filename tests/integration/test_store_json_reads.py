"""A Store connection reads json / jsonb columns with jobstream.store.loads_json (orjson's
speed, json.loads's values; issue 12, perf-worker8) and writes its Jsonb parameters with
jobstream.store.dumps_json (orjson's speed, json.dumps's jsonb; worker12), on real Postgres."""

from __future__ import annotations

import json
from collections.abc import Iterator

import psycopg
import pytest
from psycopg.adapt import PyFormat
from psycopg.types.json import Jsonb

from jobstream.settings import Settings
from jobstream.store import Store

# What Postgres sends back for these (jsonb normalises; json keeps the text).
TEXT = (
    '{"big": 18446744073709551616, "neg": -9453031159136967820, "f": 0.30000000000000004, '
    '"s": "\\u00e9t\\u00e9", "l": [1, 2.5, null, true], "z": 1.0}'
)

SELECT = {
    "jsonb": "SELECT %s::jsonb AS v, %s::jsonb::text AS t",
    "json": "SELECT %s::json AS v, %s::json::text AS t",
}


@pytest.fixture
def store(settings: Settings) -> Iterator[Store]:
    s = Store(settings.database_url, max_size=1)
    yield s
    s.close()


@pytest.mark.parametrize("column_type", ["jsonb", "json"])
def test_a_store_connection_reads_json_columns_as_json_loads_does(
    store: Store, column_type: str
) -> None:
    with store.connection() as conn:
        got = conn.execute(SELECT[column_type], (TEXT, TEXT)).fetchone()
        loader = conn.adapters.get_loader(conn.adapters.types[column_type].oid, 0)
        assert loader is not None and loader._loads.__name__ == "loads_json"  # type: ignore[attr-defined]  # psycopg's class attribute
    assert got is not None
    want = json.loads(got["t"])
    assert repr(got["v"]) == repr(want)
    assert got["v"]["big"] == 18446744073709551616 and isinstance(got["v"]["neg"], int)


# Written through a Store connection's Jsonb (dumps_json, issue 12, worker12): the same jsonb
# as json.dumps's text, and NaN refused by Postgres as before.
WRITTEN = [
    {"text": "\u00e9t\u00e9 \u2603 \U0001f600", "n": 1.5e-05, "big": 1e16, "i": 2**63 - 1,
     "l": [0.1, 0.30000000000000004, -0.0, 5e-324], "b": True},
    {"with": None, "k": [1, {"x": "y"}]},
    {1: "int key"},
    {"huge": 2**70},
]


@pytest.mark.parametrize("value", WRITTEN, ids=range(len(WRITTEN)))
def test_a_store_connection_writes_jsonb_as_json_dumps_does(store: Store, value: object) -> None:
    with store.connection() as conn:
        dumper = conn.adapters.get_dumper(Jsonb, PyFormat.AUTO)
        assert dumper._dumps.__name__ == "dumps_json"  # type: ignore[attr-defined]  # psycopg's class attribute
        got = conn.execute("SELECT %s::jsonb = %s::jsonb AS same, %s::jsonb::text AS t",
                           (Jsonb(value), json.dumps(value), Jsonb(value))).fetchone()
    assert got is not None and got["same"], got


def test_nan_in_a_jsonb_parameter_is_still_refused(store: Store) -> None:
    with store.connection() as conn, pytest.raises(psycopg.DataError):
        conn.execute("SELECT %s::jsonb", (Jsonb({"score": float("nan")}),))
