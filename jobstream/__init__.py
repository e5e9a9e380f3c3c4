"""jobstream: uploaded documents in, LLM results out, effects applied exactly once.

The package holds what the pipeline shares: settings, the job store (all SQL), the provider
client, the stage functions and the CLI. The faust agents live in ``streams/``, the idempotent
consumer in ``consumers/``, the event contracts in ``schemas/`` and the outbox relay in
``outbox_relay/``.
"""

__version__ = "0.1.0"
