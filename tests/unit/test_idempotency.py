"""The one idempotency-key decision shared by the job and batch endpoints."""

from __future__ import annotations

import uuid

import pytest

from jobstream.errors import IdempotencyConflict
from jobstream.idempotency import batch_request_hash, bound_target


def test_bound_target_new_replay_and_conflict() -> None:
    target = uuid.uuid4()
    assert bound_target(None, key="k", request_hash="a" * 64, target="job") is None
    record = {"batch_id": target, "request_hash": "a" * 64}
    assert bound_target(record, key="k", request_hash="a" * 64, target="batch") == target
    with pytest.raises(IdempotencyConflict, match=str(target)) as err:
        bound_target(record, key="k", request_hash="b" * 64, target="batch")
    assert err.value.code == "idempotency_key_conflict"


def test_batch_request_hash_depends_on_each_document_and_the_order() -> None:
    a, b = "a" * 64, "b" * 64
    assert batch_request_hash([a, b]) == batch_request_hash([a, b])
    assert len({batch_request_hash([a, b]), batch_request_hash([b, a]),
                batch_request_hash([a])}) == 3
