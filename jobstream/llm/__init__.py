"""The LLM provider side: model profiles, the OpenAI-compatible httpx client, the local model."""
