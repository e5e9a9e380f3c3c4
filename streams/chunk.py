"""Stage ``chunk``: ``job.text_extracted`` -> checkpoint ``chunk`` (and the chunk rows) ->
``job.chunks_ready``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jobstream.errors import RetryableError
from jobstream.keys import canonical_json, sha256_hex
from jobstream.store import Claim
from jobstream.textproc import chunk_text
from schemas.events import ChunksReadyPayload
from schemas.pipeline import PIPELINE
from streams.context import StageContext, StageResult
from streams.runner import register_stage

if TYPE_CHECKING:
    import faust

STAGE = PIPELINE.stage("chunk")
#: What the claim transaction reads for this stage (``Store.claim``'s ``reads``).
READS = ("output:extract",)


def one_transaction(ctx: StageContext, ev: Any) -> bool:
    """Cutting text is short and pure: claim, chunk and complete in ONE transaction."""
    return True


def work(ctx: StageContext, claim: Claim, ev: Any) -> StageResult:
    """The chunk checkpoint: the extract checkpoint's text cut into chunk rows. Raises
    :class:`RetryableError` ``not_ready`` while that checkpoint is not visible."""
    extracted = (claim.inputs.previous_output
                 or ctx.store.stage_output(claim.job.job_id, "extract"))
    if extracted is None:
        raise RetryableError("extract checkpoint not visible yet", code="not_ready")
    text = extracted["text"]
    chunks = chunk_text(text, ctx.settings.chunk_size_chars)
    rows = [(c.idx, c.start, c.end, c.text, sha256_hex(c.text)) for c in chunks]
    digest = sha256_hex(canonical_json([r[4] for r in rows]))
    return StageResult(
        output={"chunk_count": len(rows), "chunks_sha256": digest,
                "chunk_size_chars": ctx.settings.chunk_size_chars},
        input_hash=sha256_hex(text), code_version=ctx.code_version(STAGE.name),
        chunks=rows,
        payload=ChunksReadyPayload(chunk_count=len(rows), chunks_sha256=digest))


def register(app: faust.App, ctx: StageContext) -> Any:
    """Register the chunk agent on ``job.text_extracted`` (prefixed by settings)."""
    return register_stage(app, ctx, STAGE)
