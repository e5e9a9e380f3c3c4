"""jobstream.store.typed_row: a row's fields set at once into a plain frozen dataclass (issue
12, worker12) give the object its ``__init__`` gives, and every other case still goes through
``__init__`` (defaults, ``TypeError``, ``__post_init__``, default factories)."""

from __future__ import annotations

import dataclasses
import datetime
import uuid
from decimal import Decimal
from typing import Any

import pytest

from jobstream.store import ChunkRow, JobRow, StageCheckpoint, typed_row

NOW = datetime.datetime(2026, 12, 7, tzinfo=datetime.UTC)
JOB: dict[str, Any] = {
    "job_id": uuid.UUID(int=7), "tenant_id": "t", "idempotency_key": "k", "request_hash": "h",
    "dedup_key": "d", "request_id": "r", "document_sha256": "s", "filename": "f",
    "content_type": "text/plain", "pipeline": "p", "prompt_version": "v",
    "model_profile": "local", "lane": "interactive", "status": "running",
    "current_stage": "llm", "cancel_requested": False, "error_code": None, "error": None,
    "cost_usd": Decimal("0.5"), "charge_usd": Decimal(0), "created_at": NOW, "updated_at": NOW,
    "finished_at": None, "generation": 3, "cancel_requested_at": None, "trace_id": "x",
    "sweeps": 1, "swept_at": None}


def _by_init(cls: type, row: dict[str, Any]) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in row.items() if k in names})


@pytest.mark.parametrize("row", [
    JOB,
    {**JOB, "processed": False, "claim_attempt": 1, "r_chunks": None},  # extra columns
])
def test_a_full_row_is_the_object_init_makes(row: dict[str, Any]) -> None:
    got, want = typed_row(JobRow, row), _by_init(JobRow, row)
    assert got == want and hash(got) == hash(want) and repr(got) == repr(want)
    assert vars(got) == vars(want)
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.status = "failed"  # type: ignore[misc]  # frozen: the point of the test


def test_a_row_without_a_defaulted_column_gets_the_default() -> None:
    row = {k: v for k, v in JOB.items() if k not in ("generation", "sweeps", "trace_id")}
    got = typed_row(JobRow, row)
    assert (got.generation, got.sweeps, got.trace_id) == (0, 0, None)
    assert got == _by_init(JobRow, row)


def test_a_row_without_a_required_column_raises_type_error() -> None:
    with pytest.raises(TypeError):
        typed_row(JobRow, {k: v for k, v in JOB.items() if k != "status"})


def test_other_row_classes() -> None:
    assert typed_row(ChunkRow, {"idx": 0, "text": "a", "text_sha256": "h", "x": 1}) == ChunkRow(
        0, "a", "h")
    cp = {f.name: None for f in dataclasses.fields(StageCheckpoint)}
    assert typed_row(StageCheckpoint, cp) == _by_init(StageCheckpoint, cp)


@dataclasses.dataclass(frozen=True)
class _Checked:
    n: int

    def __post_init__(self) -> None:
        if self.n < 0:
            raise ValueError("negative")


@dataclasses.dataclass(frozen=True)
class _Factory:
    n: int
    tags: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Mutable:
    n: int


def test_classes_the_shortcut_does_not_fit_go_through_init() -> None:
    with pytest.raises(ValueError, match="negative"):
        typed_row(_Checked, {"n": -1})
    a = typed_row(_Factory, {"n": 1})
    assert a.tags == [] and a.tags is not typed_row(_Factory, {"n": 1}).tags
    assert typed_row(_Mutable, {"n": 2}) == _Mutable(2)
