"""The keys that are never merged (design.md, "Three keys").

``dedup_key``: sha256 of the canonical JSON (RFC 8785-style: sorted keys, no whitespace, UTF-8)
of ``tenant_id, document_hash, pipeline, prompt_version, model_profile``. It is tenant-scoped,
never drops the prompt version or model profile, and never includes transport fields
(timestamps, event ids).

``request_hash``: sha256 of the canonical JSON of the client's request body (the same fields
without the tenant, plus the lane): the same idempotency key with a different body is a conflict.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def canonical_json(obj: Any) -> bytes:
    """Deterministic JSON bytes: sorted keys, compact separators, UTF-8, no NaN."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode()


def sha256_hex(data: bytes | str) -> str:
    """Lowercase hex sha256 of bytes (str is UTF-8 encoded first)."""
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def dedup_key(*, tenant_id: str, document_hash: str, pipeline: str, prompt_version: str,
              model_profile: str) -> str:
    """The computation's identity (64 hex chars); see the module docstring for the rule."""
    return sha256_hex(canonical_json({
        "tenant_id": tenant_id, "document_hash": document_hash, "pipeline": pipeline,
        "prompt_version": prompt_version, "model_profile": model_profile,
    }))


def request_hash(*, document_hash: str, pipeline: str, prompt_version: str, model_profile: str,
                 lane: str) -> str:
    """Hash of one client request body (64 hex chars), compared under one idempotency key."""
    return sha256_hex(canonical_json({
        "document_hash": document_hash, "pipeline": pipeline, "prompt_version": prompt_version,
        "model_profile": model_profile, "lane": lane,
    }))
