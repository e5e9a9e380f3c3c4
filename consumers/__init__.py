"""Idempotent consumers of jobstream's output topics (``job.ready`` and friends)."""

from consumers.idempotent import IdempotentConsumer

__all__ = ["IdempotentConsumer"]
