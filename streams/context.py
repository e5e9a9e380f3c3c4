"""What every stage's code shares: the :class:`StageContext` (settings, store, provider
clients, the shared provider limit), the :class:`StageResult` a stage's work returns, the two
ways a run stops that are not errors of the job's input (:class:`JobCancelled`,
:class:`NeedsReconciliation`) and :func:`outbox_msg` (an event's outbox row on its lane's
topic).

The stages themselves are one module each (``streams.intake``, ``streams.extract``,
``streams.chunk``, ``streams.llm``, ``streams.validate``, ``streams.publish``), the
claim/complete protocol is ``streams.runner`` and the operator actions ``streams.actions``;
their order, names and topics are ``schemas.pipeline.PIPELINE``.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from jobstream.errors import JobstreamError
from jobstream.kafka import topic_for
from jobstream.limiter import SharedLimiter
from jobstream.llm.client import ProviderClient
from jobstream.llm.profiles import ModelProfile
from jobstream.settings import Settings
from jobstream.store import LocalAnswer, OutboxMessage, Store, outbox_message
from schemas.pipeline import PIPELINE


class JobCancelled(JobstreamError):
    """The user cancelled the job; the run stops before its next provider call."""

    code = "cancelled_by_user"


class NeedsReconciliation(JobstreamError):
    """A provider call's outcome is unknown and the lane's policy is to park the job."""

    code = "outcome_unknown"


@dataclass
class StageContext:
    """What stage code needs: settings, the store, and one provider client per profile."""

    settings: Settings
    store: Store
    _clients: dict[str, ProviderClient] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _limiter: SharedLimiter | None = None

    @property
    def limiter(self) -> SharedLimiter:
        """The provider concurrency limit shared by all workers (made on first use)."""
        with self._lock:
            if self._limiter is None:
                s = self.settings
                self._limiter = SharedLimiter(self.store, max_limit=s.provider_max_concurrency,
                                              reserved=s.provider_interactive_reserved,
                                              hold_s=s.provider_timeout_s
                                              + s.provider_slot_margin_s)
            return self._limiter

    def code_version(self, stage: str) -> str:
        """The code version of ``stage`` in force (settings may override the built-in one)."""
        return self.settings.stage_code_versions.get(stage, PIPELINE.stage(stage).code_version)

    def group(self, stage: str) -> str:
        """Idempotent-consumer group name of a stage (prefixed like Kafka groups)."""
        return self.settings.group(f"jobstream-{stage}")

    def client(self, profile: ModelProfile) -> ProviderClient:
        """The (cached) provider client of ``profile``; base URL/key overridable by settings."""
        with self._lock:
            if profile.name not in self._clients:
                base = self.settings.provider_base_url if profile.base_url else None
                secret = self.settings.provider_api_key
                key = (secret.get_secret_value() if secret else None) or (
                    os.environ.get(profile.api_key_env) if profile.api_key_env else None)
                self._clients[profile.name] = ProviderClient(
                    profile, timeout_s=self.settings.provider_timeout_s, base_url=base,
                    api_key=key)
            return self._clients[profile.name]

    def close(self) -> None:
        """Close provider clients (the store is closed by its owner)."""
        for c in self._clients.values():
            c.close()



@dataclass(frozen=True)
class StageResult:
    """What a stage's work produced: checkpoint output, input hash, code version, cost (USD),
    the next event's payload, and side rows (chunks), the user charge (publish) or the chunks
    answered in-process (``local_answers``, recorded by the completion transaction)."""

    output: Any
    input_hash: str
    code_version: str
    payload: BaseModel
    cost_usd: float = 0.0
    chunks: list[tuple[int, int, int, str, str]] | None = None
    charge_usd: float | None = None
    local_answers: tuple[LocalAnswer, ...] = ()



def outbox_msg(ctx: StageContext, event: Any, lane: str | None = None) -> OutboxMessage:
    """The outbox row of ``event``, on the topic of the job's ``lane`` (``Stage.lanes``)."""
    return outbox_message(ctx.settings.topic(topic_for(event.event_type, lane)), event)

