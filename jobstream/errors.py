"""One exception tree, split by how the caller must react.

``RetryableError``: try again later (backoff, retry topic). ``PermanentError``: fail the job now,
no retry. ``PoisonMessage``: the message itself is bad; dead-letter it and move on.
``OutcomeUnknown``: a request was sent but no answer came; it may have taken effect.
``StaleRun``: a newer run owns the stage (fencing); discard this run's result.
"""

from __future__ import annotations


class JobstreamError(Exception):
    """Base of every jobstream error; ``code`` is a stable machine-readable reason."""

    code = "error"

    def __init__(self, message: str | None = None, *, code: str | None = None) -> None:
        if code is not None:
            self.code = code
        super().__init__(message or (self.__doc__ or self.code).strip().splitlines()[0])


class RetryableError(JobstreamError):
    """A transient failure; the same work may succeed later."""

    code = "transient"

    def __init__(
        self, message: str | None = None, *, code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message, code=code)
        self.retry_after_s = retry_after_s


class PermanentError(JobstreamError):
    """A failure that retrying cannot fix; the job fails with this reason."""

    code = "permanent"


class PoisonMessage(JobstreamError):
    """The message cannot be decoded or violates its schema; it goes to the DLQ."""

    code = "poison"


class OutcomeUnknown(JobstreamError):
    """The request was sent but the answer never came; it may or may not have taken effect."""

    code = "outcome_unknown"


class StaleRun(JobstreamError):
    """A newer run (fencing token) owns this stage; this run's result is discarded."""

    code = "stale_run"


class IdempotencyConflict(PoisonMessage):
    """The idempotency key was already used for a different request body."""

    code = "idempotency_key_conflict"
