"""jobstream.store.dumps_json: orjson's speed for the Store's ``Jsonb`` parameters and intake's
JSON text arrays (issue 12, worker12), with the JSON value ``json.dumps`` writes, errors
included. Numbers are compared as decimals of their text (what ``jsonb`` keeps: ``numeric``),
so ``1e-05`` and ``0.00001`` are the same number, and ``0.1`` and ``0.1000000000000000055``
are not."""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import random
import struct
from decimal import Decimal
from typing import Any

import orjson
import pytest

from jobstream.store import dumps_json


class _Str(str):
    pass


class _Int(int):
    pass


@dataclasses.dataclass
class _Point:
    x: int


def _value(text: bytes | str) -> Any:
    """The JSON value of ``text`` with every number as a Decimal (jsonb's ``numeric``)."""
    return json.loads(text, parse_float=Decimal, parse_int=Decimal,
                      parse_constant=lambda c: ("constant", c))


def _check(value: Any) -> None:
    try:
        want = json.dumps(value)
    except (TypeError, ValueError, RecursionError) as exc:
        with pytest.raises(type(exc)):
            dumps_json(value)
        return
    got = dumps_json(value)
    assert isinstance(got, bytes)
    assert _value(got) == _value(want)


EDGES: list[Any] = [
    float("nan"),
    {"score": float("inf")},
    [1.0, -math.inf],
    {"deeper": [({"x": None, "y": float("nan")},), "null"]},
    {"none": None, "text": "null and void", "n": [None, 1.5]},
    {1: "int key", None: "null key", 2.5: "float key", False: "bool key"},
    2**64,
    -(2**63) - 1,
    [2**63 - 1, -(2**63), 2**64 - 1],
    "\ud800",
    {"s": "lone \udfff"},
    {"t": "\u00e9t\u00e9 \u2603 \U0001f600 \x00 \x1f \" \\ /"},
    [1.5e-05, 1e16, 1e-7, 0.1, 0.30000000000000004, -0.0, 5e-324, 1.7976931348623157e308],
    {"none": None, "b": [True, False], "nested": {"l": [[], {}]}},
    ("tuple", 1),
    _Str("a str subclass"),
    {"k": _Int(7)},
    {_Str("k"): 1},
    [[[[]]]] * 3,
    [0] * 0,
    datetime.datetime(2026, 12, 7, tzinfo=datetime.UTC),
    datetime.date(2026, 12, 7),
    _Point(1),
    {"set": {1, 2}},
    b"bytes",
    {"deep": json.loads("[" * 300 + "]" * 300)},
]


@pytest.mark.parametrize("value", EDGES, ids=range(len(EDGES)))
def test_the_same_json_value_or_error_as_json_dumps(value: Any) -> None:
    _check(value)


def test_nesting_past_orjsons_limit_is_json_dumps_output() -> None:
    deep: Any = []
    for _ in range(400):
        deep = [deep]
    assert dumps_json(deep) == json.dumps(deep).encode()


def test_random_floats_and_ints_are_the_same_numbers() -> None:
    rng = random.Random(12)
    for _ in range(30_000):
        f = struct.unpack("<d", rng.getrandbits(64).to_bytes(8, "little"))[0]
        n = rng.choice([rng.getrandbits(rng.randint(1, 70)), -rng.getrandbits(63)])
        _check({"f": f, "n": n, "d": round(rng.uniform(-1e6, 1e6), rng.randint(0, 12))})


def test_a_stage_output_is_orjsons_text() -> None:
    """The common case takes the fast path (no fallback): a stage output without nulls."""
    out = {"text": "\u00e9t\u00e9 " * 100, "page_count": 1, "score": 0.75, "tags": ["a"]}
    assert dumps_json(out) != json.dumps(out).encode()  # orjson's form: no spaces, UTF-8
    assert json.loads(dumps_json(out)) == out


def test_a_value_with_nulls_but_no_nan_is_orjsons_text() -> None:
    """A ``None`` field or the word "null" in a text is no NaN: orjson's text, encoded once
    (adv14: such values had gone through ``json.dumps`` as well)."""
    out = {"text": "null and void \u00e9t\u00e9", "missing": None, "scores": [0.5, None]}
    got = dumps_json(out)
    assert got == orjson.dumps(out)
    assert got != json.dumps(out).encode()
    assert json.loads(got) == out

