"""A Store connection reads json / jsonb columns with jobstream.store.loads_json (orjson's
speed, json.loads's values; issue 12, perf-worker8), on real Postgres."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

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
