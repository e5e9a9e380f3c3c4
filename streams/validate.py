"""Validation: job.llm_done -> merged model output validated against DocumentAnalysis -> checkpoint
validated -> job.validated.
"""

from __future__ import annotations

from typing import Any

import faust

from jobstream.stages import StageContext, run_stage
from streams.base import register_stage_agent

CONSUMES = "job.llm_done"


def register(app: faust.App, ctx: StageContext) -> Any:
    """Register the validate agent on ``job.llm_done`` (prefixed by settings)."""
    return register_stage_agent(app, ctx, name="validate", consumes=CONSUMES, handler=run_stage)
