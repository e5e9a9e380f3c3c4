"""The outbox relay: publishes committed outbox rows to Kafka (``jobstream relay``)."""
