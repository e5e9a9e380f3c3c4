"""The errors a consumed message can raise, split by how the consumer must react.

Shared by ``schemas`` (decoding), the consumer library (``consumers``) and jobstream
(``jobstream.errors`` re-exports them): ``RetryableError`` (try again later), ``PoisonMessage``
(the message itself is bad: dead-letter it and move on), ``OutcomeUnknown`` (a request was
sent, no answer came). Nothing here imports jobstream.
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


class PoisonMessage(JobstreamError):
    """The message cannot be decoded or violates its schema; it goes to the DLQ."""

    code = "poison"


class OutcomeUnknown(JobstreamError):
    """The request was sent but the answer never came; it may or may not have taken effect."""

    code = "outcome_unknown"
