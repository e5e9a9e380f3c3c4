"""Record batches that survive a header name which is not UTF-8 (faust's aiokafka consumer).

Kafka header names are bytes on the wire; aiokafka decodes them as strict UTF-8 while it
unpacks a fetched batch, in its fetcher, before any agent sees the message. One message with a
header name such as ``b"\\xff"`` made that decode raise, which crashed faust's Fetcher and the
whole worker, again on every restart (every stage stopped, the partition never moved).

:func:`install` makes aiokafka's fetcher unpack batches that way: the fast (Cython) reader
first; when it fails on a batch, the same bytes are read again with aiokafka's pure-Python
reader whose header names are decoded with ``backslashreplace`` (``"\\\\xff"``: valid UTF-8, so
the message can still be dead-lettered and replayed; keys, values and header values are bytes
and untouched). The records yielded before the failure are not yielded twice.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from aiokafka.consumer import fetcher
from aiokafka.errors import CorruptRecordException
from aiokafka.record import default_records
from aiokafka.record.memory_records import _MemoryRecordsPy


class _LenientBytes(bytes):
    """Bytes whose ``decode`` never raises (``backslashreplace``)."""

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:  # noqa: ARG002
        return bytes.decode(self, encoding, "backslashreplace")


class _LenientBuffer(bytearray):
    """A batch buffer whose slices decode leniently (what the reader decodes header names of)."""

    def __getitem__(self, item: Any) -> Any:
        got = bytearray.__getitem__(self, item)
        return _LenientBytes(got) if isinstance(item, slice) else got


class _LenientBatch(default_records._DefaultRecordBatchPy):  # type: ignore[misc]  # aiokafka: untyped
    """aiokafka's pure-Python batch reader, decoding header names leniently."""

    _buffer: bytearray  # set by the base class (aiokafka's batch bytes)

    def __iter__(self) -> Any:
        it = super().__iter__()  # decompresses into self._buffer
        if not isinstance(self._buffer, _LenientBuffer):
            self._buffer = _LenientBuffer(self._buffer)
        return it


class _TolerantBatch:
    """One fetched batch: the fast reader, then the lenient one from where it failed."""

    def __init__(self, data: Any) -> None:
        self._data = data
        self._fast = default_records.DefaultRecordBatch(data)
        self._iter: Iterator[Any] | None = None

    def __getattr__(self, name: str) -> Any:  # base_offset, next_offset, producer_id, ...
        return getattr(self._fast, name)

    def validate_crc(self) -> bool:
        return bool(self._fast.validate_crc())

    def _records(self) -> Iterator[Any]:
        last = None
        try:
            for rec in self._fast:
                last = rec.offset
                yield rec
            return
        except (UnicodeDecodeError, CorruptRecordException):
            pass  # read the same bytes again, leniently (a real corruption raises again)
        for rec in _LenientBatch(self._data):
            if last is None or rec.offset > last:
                yield rec

    def __iter__(self) -> _TolerantBatch:
        return self

    def __next__(self) -> Any:
        if self._iter is None:
            self._iter = self._records()
        return next(self._iter)


class TolerantMemoryRecords(_MemoryRecordsPy):  # type: ignore[misc]  # aiokafka: untyped
    """aiokafka's record-set reader whose v2 batches are :class:`_TolerantBatch`."""

    def next_batch(self, _min_slice: int = _MemoryRecordsPy.MIN_SLICE,
                   _magic_offset: int = _MemoryRecordsPy.MAGIC_OFFSET) -> Any:
        data = self._next_slice
        if data is not None and len(data) >= _min_slice and data[_magic_offset] >= 2:
            self._cache_next()
            return _TolerantBatch(data)
        return super().next_batch(_min_slice, _magic_offset)


def install() -> None:
    """Make aiokafka's fetcher (faust's consumer) read batches with
    :class:`TolerantMemoryRecords`. Idempotent; call before the worker starts consuming."""
    fetcher.MemoryRecords = TolerantMemoryRecords
