"""Text extraction: job.accepted -> checkpoint text_extracted (plain text, PDF via pypdf) ->
job.text_extracted.
"""

from __future__ import annotations

from typing import Any

import faust

from jobstream.stages import StageContext, run_stage
from streams.base import register_stage_agent

CONSUMES = "job.accepted"


def register(app: faust.App, ctx: StageContext) -> Any:
    """Register the extract agent on ``job.accepted`` (prefixed by settings)."""
    return register_stage_agent(app, ctx, name="extract", consumes=CONSUMES, handler=run_stage)
