"""Intake: document.uploaded -> one transaction creating the job, its uploaded checkpoint and the
job.accepted outbox row. A reused idempotency key maps to the same job; a reused key with
another body is dead-lettered (idempotency_key_conflict).
"""

from __future__ import annotations

from typing import Any

import faust

from jobstream.stages import StageContext, handle_intake
from streams.base import register_stage_agent

CONSUMES = "document.uploaded"


def register(app: faust.App, ctx: StageContext) -> Any:
    """Register the intake agent on ``document.uploaded`` (prefixed by settings)."""
    return register_stage_agent(app, ctx, name="intake", consumes=CONSUMES, handler=handle_intake)
