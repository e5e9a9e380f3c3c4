"""streams/records.py: aiokafka batches with a header name that is not UTF-8 are read, not
raised on (the worker's fetcher crashed on them). Batches are built with aiokafka's own
record builder, the bytes a broker returns on fetch; plain and compressed."""

from __future__ import annotations

import struct

import pytest
from aiokafka.record.default_records import _DefaultRecordBatchBuilderPy

from streams.records import TolerantMemoryRecords


class _RawName(str):
    """A header name object that aiokafka's builder encodes to arbitrary bytes."""

    def __new__(cls, raw: bytes) -> _RawName:
        obj = super().__new__(cls, raw.decode("latin-1"))
        obj.raw = raw  # type: ignore[attr-defined]
        return obj

    def encode(self, *_: object, **__: object) -> bytes:  # type: ignore[override]
        return self.raw  # type: ignore[attr-defined,no-any-return]


def _batch(base: int, codec: int, headers: list[list[tuple[str, bytes | None]]]) -> bytes:
    b = _DefaultRecordBatchBuilderPy(magic=2, compression_type=codec, is_transactional=0,
                                     producer_id=-1, producer_epoch=-1, base_sequence=-1,
                                     batch_size=1 << 20)
    for i, h in enumerate(headers):
        assert b.append(i, timestamp=None, key=b"k", value=b"v" * 2000, headers=h) is not None
    data = b.build()
    struct.pack_into(">q", data, 0, base)
    return bytes(data)


@pytest.mark.parametrize("codec", [0, 1, 3])  # none, gzip, lz4
def test_non_utf8_header_name_is_read_with_backslashes_and_nothing_is_skipped(codec: int) -> None:
    bad = _RawName(b"\xff\xfe-name")
    data = (_batch(0, codec, [[("a", b"1")], [(bad, b"x"), ("dup", b"1"), ("dup", None)],
                              [("c", b"3")]])
            + _batch(3, codec, [[("d", b"4")]]))
    records = TolerantMemoryRecords(data)
    got = []
    while records.has_next():
        for rec in records.next_batch():
            got.append((rec.offset, [k for k, _ in rec.headers], rec.value))
    assert [o for o, _, _ in got] == [0, 1, 2, 3]
    assert got[1][1] == ["\\xff\\xfe-name", "dup", "dup"]
    assert got[0][1] == ["a"] and got[2][1] == ["c"] and got[3][1] == ["d"]
    assert all(v == b"v" * 2000 for _, _, v in got)
