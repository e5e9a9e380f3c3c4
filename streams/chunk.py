"""Chunking: job.text_extracted -> checkpoint chunks_ready (chunk rows) -> job.chunks_ready."""

from __future__ import annotations

from typing import Any

import faust

from jobstream.stages import StageContext, run_stage
from streams.base import register_stage_agent

CONSUMES = "job.text_extracted"


def register(app: faust.App, ctx: StageContext) -> Any:
    """Register the chunk agent on ``job.text_extracted`` (prefixed by settings)."""
    return register_stage_agent(app, ctx, name="chunk", consumes=CONSUMES, handler=run_stage)
