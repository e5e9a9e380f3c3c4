"""One exception tree, split by how the caller must react.

``RetryableError``: try again later (backoff, retry topic). ``PermanentError``: fail the job now,
no retry. ``PoisonMessage``: the message itself is bad; dead-letter it and move on.
``OutcomeUnknown``: a request was sent but no answer came; it may have taken effect.
``StaleRun``: a newer run owns the stage (fencing); discard this run's result.
"""

from __future__ import annotations

from schemas.errors import (  # noqa: F401 - re-exported: one exception tree
    JobstreamError,
    OutcomeUnknown,
    PoisonMessage,
    RetryableError,
)


class PermanentError(JobstreamError):
    """A failure that retrying cannot fix; the job fails with this reason."""

    code = "permanent"


class StaleRun(JobstreamError):
    """A newer run (fencing token) owns this stage; this run's result is discarded."""

    code = "stale_run"


class IdempotencyConflict(PoisonMessage):
    """The idempotency key was already used for a different request body."""

    code = "idempotency_key_conflict"
