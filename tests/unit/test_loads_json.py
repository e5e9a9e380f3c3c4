"""jobstream.store.loads_json: orjson's speed for the workers' json / jsonb reads (issue 12,
perf-worker8), with exactly ``json.loads``'s values, errors included."""

from __future__ import annotations

import json
import math
import random
import struct

import pytest

from jobstream.store import loads_json

# Integers orjson 3.13 reads as floats (outside int64 / uint64) and texts it refuses.
EDGES = [
    b"18446744073709551616",
    b"-9223372036854775809",
    b"[1, 99999999999999999999999999]",
    b'{"n": -9453031159136967820}',
    b"18446744073709551615",
    b"-9223372036854775808",
    b"NaN",
    b"[Infinity, -Infinity]",
    b"1e400",
    b'"\\ud800"',
    b'{"a": 1, "a": 2}',
    b'{"k": [1.5, 0.1, -0.0, 1e-7, 12345678901234567.0, true, null, "\\u00e9"]}',
    b"[" * 1100 + b"]" * 1100,
    b"0." + b"0" * 40 + b"1",
]


@pytest.mark.parametrize("text", EDGES, ids=range(len(EDGES)))
def test_the_same_value_or_error_as_json_loads(text: bytes) -> None:
    try:
        want = json.loads(text)
    except (ValueError, RecursionError) as exc:
        with pytest.raises(type(exc)):
            loads_json(text)
        return
    got = loads_json(text)
    assert repr(got) == repr(want) and type(got) is type(want)


def test_random_numbers_read_as_json_reads_them() -> None:
    rng = random.Random(12)
    texts = []
    for _ in range(8_000):
        x = struct.unpack("d", rng.getrandbits(64).to_bytes(8, "little"))[0]
        if math.isfinite(x):
            texts.append(repr(x).encode())
        texts.append(str(rng.randint(-(2**70), 2**70)).encode())
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 30)))
        texts.append(f"{rng.randint(0, 10**12)}.{digits}".encode())
    got = [loads_json(t) for t in texts]
    want = [json.loads(t) for t in texts]
    assert [(type(v), repr(v)) for v in got] == [(type(v), repr(v)) for v in want]


def test_text_goes_to_json_loads() -> None:
    assert loads_json('{"n": 18446744073709551616}') == {"n": 18446744073709551616}
