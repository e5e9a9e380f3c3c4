"""Idempotency keys (IETF draft "The Idempotency-Key HTTP Header Field"): one implementation of
"is this key already bound, to the same request?" for every intent that carries a key — a job
(:meth:`jobstream.store.Store.intake`) and a batch (``POST /v1/batches``).

A key is bound to one target (a job or a batch) and the ``request_hash`` of the request that
created it (:func:`jobstream.keys.request_hash`; a batch hashes its documents' request hashes,
:func:`batch_request_hash`). The same key with the same hash is a replay (the same target, no
new work); with another hash it is a conflict (:class:`IdempotencyConflict`, HTTP 409). Looking
the record up is the caller's query (each target has its own table); comparing and deciding is
here, so the two endpoints cannot drift apart.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from jobstream.errors import IdempotencyConflict
from jobstream.keys import canonical_json, request_hash, sha256_hex
from schemas.events import DocumentUploadedPayload


def bound_target(record: Mapping[str, Any] | None, *, key: str, request_hash: str,
                 target: str) -> uuid.UUID | None:
    """The target a key is already bound to, or ``None`` for a key never seen.

    Parameters
    ----------
    record
        The stored idempotency record (a row with ``request_hash`` and ``<target>_id``), or
        ``None`` when the lookup found nothing.
    key
        The idempotency key (for the error message).
    request_hash
        The hash of the request now being made (64 hex chars).
    target
        ``"job"`` or ``"batch"``: the record's id column is ``<target>_id``.

    Raises
    ------
    IdempotencyConflict
        The key was bound to a request with another hash.

    Example
    -------
    >>> bound_target(None, key="k", request_hash="ab", target="job") is None
    True
    """
    if record is None:
        return None
    target_id: uuid.UUID = record[f"{target}_id"]
    if record["request_hash"] != request_hash:
        raise IdempotencyConflict(f"idempotency key {key!r} was used for another request body "
                                  f"({target} {target_id})")
    return target_id


def document_request_hash(payload: DocumentUploadedPayload,
                          document_hash: str | None = None) -> str:
    """The request hash of one document's intent (64 hex chars): every field that changes the
    job (:func:`jobstream.keys.request_hash`). ``document_hash``: the sha256 of the bytes
    actually read, when known (intake); else the one the payload declares."""
    return request_hash(document_hash=document_hash or payload.document.sha256,
                        pipeline=payload.pipeline, prompt_version=payload.prompt_version,
                        model_profile=payload.model_profile, lane=payload.lane,
                        filename=payload.document.filename,
                        content_type=payload.document.content_type)


def batch_request_hash(document_hashes: Sequence[str]) -> str:
    """The request hash of a batch (64 hex chars): the sha256 of the canonical JSON list of its
    documents' request hashes (:func:`jobstream.keys.request_hash`, which covers each
    document's lane), in order. The same documents in another order are another batch."""
    return sha256_hex(canonical_json(list(document_hashes)))
