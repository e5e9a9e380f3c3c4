"""Stage ``extract``: ``job.accepted`` -> checkpoint ``extract`` (the document's plain text;
PDF via pypdf, bounded by the ``extract_*`` limits) -> ``job.text_extracted``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jobstream.keys import sha256_hex
from jobstream.store import Claim
from jobstream.textproc import ExtractLimits, extract_text
from schemas.events import TextExtractedPayload
from schemas.pipeline import PIPELINE
from streams.context import StageContext, StageResult
from streams.runner import register_stage

if TYPE_CHECKING:
    import faust

STAGE = PIPELINE.stage("extract")
#: What the claim transaction reads for this stage (``Store.claim``'s ``reads``).
READS = ("document",)


def one_transaction(ctx: StageContext, ev: Any) -> bool:
    """Plain text is decoded in-process in microseconds: claim, extract and complete in ONE
    transaction. A PDF is parsed in a child process (seconds at worst): two transactions, so
    the job row is not locked meanwhile and the claim (attempt count) is durable."""
    return bool(ev.payload.content_type == "text/plain")


def work(ctx: StageContext, claim: Claim, ev: Any) -> StageResult:
    """The extract checkpoint of ``claim``'s job: its document's text. Raises
    :class:`PermanentError` when the document cannot be read within the limits."""
    job = claim.job
    # The job's content type picks the extractor (part of its dedup key): the same bytes may
    # be stored once for another job that sent them as another type.
    content = claim.inputs.document
    if content is None:
        content, _ = ctx.store.document(job.tenant_id, job.document_sha256)
    s = ctx.settings
    ex = extract_text(content, job.content_type, ExtractLimits(
        max_pages=s.extract_max_pages, max_text_chars=s.extract_max_text_chars,
        max_stream_bytes=s.extract_max_stream_bytes,
        max_memory_bytes=s.extract_max_memory_bytes, timeout_s=s.extract_timeout_s))
    return StageResult(
        output={"text": ex.text, "page_count": ex.page_count},
        input_hash=job.document_sha256, code_version=ctx.code_version(STAGE.name),
        payload=TextExtractedPayload(text_sha256=sha256_hex(ex.text), char_count=len(ex.text),
                                     page_count=ex.page_count))


def register(app: faust.App, ctx: StageContext) -> Any:
    """Register the extract agent on ``job.accepted`` (prefixed by settings)."""
    return register_stage(app, ctx, STAGE)
