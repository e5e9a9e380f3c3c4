"""Publication: job.validated -> job succeeded, checkpoint published, job.ready in the outbox."""

from __future__ import annotations

from typing import Any

import faust

from jobstream.stages import StageContext, run_stage
from streams.base import register_stage_agent

CONSUMES = "job.validated"


def register(app: faust.App, ctx: StageContext) -> Any:
    """Register the publish agent on ``job.validated`` (prefixed by settings)."""
    return register_stage_agent(app, ctx, name="publish", consumes=CONSUMES, handler=run_stage)
