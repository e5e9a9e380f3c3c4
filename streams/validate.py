"""Stage ``validate``: ``job.llm_done`` -> the chunk answers merged and validated against
``DocumentAnalysis`` -> checkpoint ``validate`` -> ``job.validated``.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from jobstream.errors import PermanentError
from jobstream.keys import canonical_json, sha256_hex
from jobstream.store import Claim
from schemas.events import DocumentAnalysis, ValidatedPayload
from schemas.pipeline import PIPELINE
from streams.context import StageContext, StageResult
from streams.runner import register_stage

if TYPE_CHECKING:
    import faust

STAGE = PIPELINE.stage("validate")
#: What the claim transaction reads for this stage (``Store.claim``'s ``reads``).
READS = ("chunks",)


def one_transaction(ctx: StageContext, ev: Any) -> bool:
    """Merging the chunk answers is short and pure: ONE transaction."""
    return True


class ChunkAnalysis(BaseModel):
    """What the model must answer for one chunk (validated leniently, extra keys ignored)."""

    title: str | None = None
    summary: str
    keywords: list[str]
    word_count: int = 0
    fields: dict[str, Any] = {}


def merge_analyses(filename: str, outputs: list[Any]) -> DocumentAnalysis:
    """Merge per-chunk model outputs into one validated :class:`DocumentAnalysis`.

    Raises :class:`PermanentError` ``invalid_model_output`` when a chunk answer or the merged
    result violates its schema (the model is not asked again: same input, same answer).
    """
    try:
        parts = [ChunkAnalysis.model_validate(o) for o in outputs]
        kw: Counter[str] = Counter()
        for rank_list in (p.keywords for p in parts):
            for rank, word in enumerate(rank_list):
                kw[word.lower()] += max(1, 10 - rank)
        fields: dict[str, Any] = {}
        for p in parts:
            for k, v in p.fields.items():
                if isinstance(v, list):
                    fields[k] = sorted(set(fields.get(k, [])) | {str(x) for x in v})[:20]
                elif k not in fields and isinstance(v, str | int):
                    # A model's true/false stays 1/0, as the (once lax) schema coerced it:
                    # DocumentAnalysis.fields takes strict integers only.
                    fields[k] = int(v) if isinstance(v, bool) else v
        summary = " ".join(p.summary for p in parts[:3] if p.summary).strip()
        return DocumentAnalysis(
            title=next((p.title for p in parts if p.title), filename),
            summary=summary[:4000],
            keywords=[w for w, _ in sorted(kw.items(), key=lambda t: (-t[1], t[0]))[:10]],
            word_count=sum(p.word_count for p in parts),
            chunk_count=len(parts),
            fields=fields,
        )
    except ValidationError as exc:
        raise PermanentError(f"model output failed validation: {exc.errors()[:3]}",
                             code="invalid_model_output") from None


def work(ctx: StageContext, claim: Claim, ev: Any) -> StageResult:
    """The validate checkpoint: the llm checkpoint's chunk answers merged into one
    ``DocumentAnalysis``. Raises :class:`PermanentError` ``invalid_model_output``."""
    chunks = claim.inputs.chunks
    if chunks is None:
        chunks = tuple(ctx.store.chunks(claim.job.job_id))
    outputs = [c.llm_output for c in chunks]
    analysis = merge_analyses(claim.job.filename, outputs)
    out = analysis.model_dump(mode="json")
    return StageResult(output=out, input_hash=sha256_hex(canonical_json(outputs)),
                       code_version=ctx.code_version(STAGE.name),
                       payload=ValidatedPayload(output_sha256=sha256_hex(canonical_json(out))))


def register(app: faust.App, ctx: StageContext) -> Any:
    """Register the validate agent on ``job.llm_done`` (prefixed by settings)."""
    return register_stage(app, ctx, STAGE)
