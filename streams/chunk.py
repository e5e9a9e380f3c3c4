"""Stage ``chunk``: ``job.text_extracted`` -> checkpoint ``chunk`` (and the chunk rows) ->
``job.chunks_ready``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jobstream.errors import PermanentError, RetryableError
from jobstream.keys import canonical_json, sha256_hex
from jobstream.store import Claim, Store
from jobstream.textproc import chunk_text, plain_text
from schemas.events import ChunksReadyPayload
from schemas.pipeline import PIPELINE
from streams.context import StageContext, StageResult
from streams.runner import register_stage

if TYPE_CHECKING:
    import faust

STAGE = PIPELINE.stage("chunk")
#: What the claim transaction reads for this stage (``Store.claim``'s ``reads``).
#: ``document:if-no-text``: the document too when the extract checkpoint holds no text (a
#: text/plain document's, migration 0045), to derive the text from.
READS = ("output:extract", "document:if-no-text")


def one_transaction(ctx: StageContext, ev: Any) -> bool:
    """Cutting text is short and pure: claim, chunk and complete in ONE transaction."""
    return True


def work(ctx: StageContext, claim: Claim, ev: Any) -> StageResult:
    """The chunk checkpoint: the extract checkpoint's text cut into chunk rows. Raises
    :class:`RetryableError` ``not_ready`` while that checkpoint is not visible,
    :class:`PermanentError` ``extract_checkpoint_mismatch`` when the text derived from the
    document is not the one the checkpoint describes (see :func:`extracted_text`)."""
    extracted = (claim.inputs.previous_output
                 or ctx.store.stage_output(claim.job.job_id, "extract"))
    if extracted is None:
        raise RetryableError("extract checkpoint not visible yet", code="not_ready")
    text = extracted_text(ctx.store, claim, extracted)
    chunks = chunk_text(text, ctx.settings.chunk_size_chars)
    rows = [(c.idx, c.start, c.end, c.text, sha256_hex(c.text)) for c in chunks]
    digest = sha256_hex(canonical_json([r[4] for r in rows]))
    return StageResult(
        output={"chunk_count": len(rows), "chunks_sha256": digest,
                "chunk_size_chars": ctx.settings.chunk_size_chars},
        input_hash=sha256_hex(text), code_version=ctx.code_version(STAGE.name),
        chunks=rows,
        payload=ChunksReadyPayload(chunk_count=len(rows), chunks_sha256=digest))


def extracted_text(store: Store, claim: Claim, extracted: dict[str, Any]) -> str:
    """The text the extract checkpoint ``extracted`` stands for: its ``"text"`` (a PDF's, or a
    checkpoint written before migration 0045), else the job's text/plain document decoded
    again by :func:`~jobstream.textproc.plain_text`, the function the extract stage used
    (the document from the claim's ``document:if-no-text`` read, or read now from ``store``
    when the checkpoint came from ``stage_output``). Raises :class:`PermanentError`
    ``extract_checkpoint_mismatch`` when that text's sha256 or length is not the checkpoint's
    (the decoding changed between the two stages' code versions: a redrive re-extracts)."""
    text = extracted.get("text")
    if text is not None:
        return str(text)
    content = claim.inputs.document
    if content is None:
        content, _ = store.document(claim.job.tenant_id, claim.job.document_sha256)
    text = plain_text(content)
    if (sha256_hex(text) != extracted.get("text_sha256")
            or len(text) != extracted.get("char_count")):
        raise PermanentError("the document's text is not the one its extract checkpoint "
                             "describes", code="extract_checkpoint_mismatch")
    return text


def register(app: faust.App, ctx: StageContext) -> Any:
    """Register the chunk agent on ``job.text_extracted`` (prefixed by settings)."""
    return register_stage(app, ctx, STAGE)
