"""LLM call: job.chunks_ready -> one provider call per chunk (each attempt logged in
provider_attempt) -> checkpoint llm_done -> job.llm_done.
"""

from __future__ import annotations

from typing import Any

import faust

from jobstream.stages import StageContext, run_stage
from streams.base import register_stage_agent

CONSUMES = "job.chunks_ready"


def register_batch(app: faust.App, ctx: StageContext) -> Any:
    """Register the batch lane's LLM agent on ``job.chunks_ready.batch``: its own topic and
    consumer pool, so batch work never queues ahead of an interactive document."""
    return register_stage_agent(app, ctx, name="llm_batch", consumes=CONSUMES,
                                topic_name=CONSUMES + ".batch", handler=run_stage,
                                concurrency=ctx.settings.llm_concurrency)


def register(app: faust.App, ctx: StageContext) -> Any:
    """Register the llm agent on ``job.chunks_ready`` (prefixed by settings)."""
    return register_stage_agent(app, ctx, name="llm", consumes=CONSUMES, handler=run_stage,
                                concurrency=ctx.settings.llm_concurrency)
