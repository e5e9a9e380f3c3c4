"""The keys that are never merged (design.md, "Three keys").

``dedup_key``: sha256 of the canonical JSON (RFC 8785-style: sorted keys, no whitespace, UTF-8)
of ``tenant_id, document_hash, pipeline, prompt_version, model_profile, extractor``. It is
tenant-scoped, never drops the prompt version or model profile, and never includes transport
fields (timestamps, event ids). ``extractor`` (``text`` or ``pypdf``, chosen from the content
type: :func:`jobstream.textproc.extractor_for`) is there because the same bytes read by another
extractor give another text, so another result (a deviation from design.md, see
docs/design-notes.md).

``request_hash``: sha256 of the canonical JSON of every field of the client's request that
changes the result or the job (the document hash, filename, content type, pipeline, prompt
version, model profile and lane; not the tenant): the same idempotency key with a different
body is a conflict.
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
              model_profile: str, extractor: str) -> str:
    """The computation's identity (64 hex chars); see the module docstring for the rule."""
    return sha256_hex(canonical_json({
        "tenant_id": tenant_id, "document_hash": document_hash, "pipeline": pipeline,
        "prompt_version": prompt_version, "model_profile": model_profile,
        "extractor": extractor,
    }))


def request_hash(*, document_hash: str, pipeline: str, prompt_version: str, model_profile: str,
                 lane: str, filename: str, content_type: str) -> str:
    """Hash of one client request body (64 hex chars), compared under one idempotency key."""
    return sha256_hex(canonical_json({
        "document_hash": document_hash, "pipeline": pipeline, "prompt_version": prompt_version,
        "model_profile": model_profile, "lane": lane, "filename": filename,
        "content_type": content_type,
    }))
