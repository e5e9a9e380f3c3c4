"""Stage ``publish``: ``job.validated`` -> the job succeeded (its charge recorded), checkpoint
``publish``, ``job.ready`` in the outbox.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jobstream.errors import RetryableError
from jobstream.keys import canonical_json, sha256_hex
from jobstream.store import Claim
from schemas.events import DocumentAnalysis, JobReadyPayload
from schemas.pipeline import PIPELINE
from streams.context import StageContext, StageResult
from streams.runner import register_stage

if TYPE_CHECKING:
    import faust

STAGE = PIPELINE.stage("publish")


def work(ctx: StageContext, claim: Claim, ev: Any) -> StageResult:
    """The publish checkpoint: the job's result and charge (USD), the ``job.ready`` payload.
    Raises :class:`RetryableError` ``not_ready`` while the validate checkpoint is not
    visible."""
    job = claim.job
    analysis = ctx.store.stage_output(job["job_id"], "validate")
    if analysis is None:
        raise RetryableError("validate checkpoint not visible yet", code="not_ready")
    cost = float(job["cost_usd"])
    charge = ctx.settings.charge_per_job_usd
    return StageResult(
        output={"published": True}, input_hash=sha256_hex(canonical_json(analysis)),
        code_version=ctx.code_version(STAGE.name), charge_usd=charge,
        payload=JobReadyPayload(result=DocumentAnalysis.model_validate(analysis),
                                document_sha256=job["document_sha256"],
                                filename=job["filename"], cost_usd=cost, charge_usd=charge))


def register(app: faust.App, ctx: StageContext) -> Any:
    """Register the publish agent on ``job.validated`` (prefixed by settings)."""
    return register_stage(app, ctx, STAGE)
