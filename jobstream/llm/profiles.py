"""Model profiles: where a model lives, what it is called, what it costs, and the prompts.

Prices are USD per 1,000,000 tokens (input, output), as providers publish them; the cost of one
attempt is ``prompt_tokens * in / 1e6 + completion_tokens * out / 1e6``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from jobstream.errors import PermanentError


@dataclass(frozen=True)
class ModelProfile:
    """One model profile. ``base_url`` is the OpenAI-compatible root (ending in ``/v1``);
    ``None`` means the in-process local model. ``api_key_env`` names the key's env variable."""

    name: str
    model: str
    base_url: str | None
    api_key_env: str | None = None
    usd_per_mtok_in: float = 0.0
    usd_per_mtok_out: float = 0.0

    def cost_usd(self, prompt_tokens: int, completion_tokens: int) -> float:
        """Cost of one attempt (USD) from its token usage."""
        return (prompt_tokens * self.usd_per_mtok_in
                + completion_tokens * self.usd_per_mtok_out) / 1_000_000


PROFILES: dict[str, ModelProfile] = {
    # Deterministic, offline, no key: an extractive model served in-process (llm/local.py).
    "local": ModelProfile("local", "jobstream-local-extractive-1", None),
    "openai": ModelProfile("openai", "gpt-4o-mini", "https://api.openai.com/v1",
                           "OPENAI_API_KEY", 0.15, 0.60),
    "ollama": ModelProfile("ollama", "llama3.2", "http://127.0.0.1:11434/v1"),
    "vllm": ModelProfile("vllm", os.environ.get("JOBSTREAM_VLLM_MODEL", "Qwen/Qwen2.5-7B-Instruct"),
                         "http://127.0.0.1:8000/v1"),
    # Any OpenAI-compatible server at JOBSTREAM_PROVIDER_BASE_URL (the fake provider in tests).
    "custom": ModelProfile("custom", os.environ.get("JOBSTREAM_CUSTOM_MODEL", "custom-model"),
                           "http://127.0.0.1:8089/v1", "JOBSTREAM_PROVIDER_API_KEY", 0.5, 1.5),
}

PIPELINES = ("document-analysis",)

PROMPTS: dict[str, str] = {
    "analysis-v1": (
        "You analyse one chunk of a document. Answer with one JSON object and nothing else: "
        '{"title": string|null (the document title if this chunk shows it), '
        '"summary": string (2 sentences at most), "keywords": [up to 8 strings], '
        '"word_count": integer, "fields": {"version": string, "years": [strings], '
        '"urls": [strings], "emails": [strings]} (omit what is absent)}.'
    ),
    "analysis-v2": (
        "You analyse one chunk of a document for a licence catalogue. Answer with one JSON "
        'object: {"title", "summary" (one sentence), "keywords" (up to 5), "word_count", '
        '"fields"} as in analysis-v1.'
    ),
}


def get_profile(name: str) -> ModelProfile:
    """The named profile. Raises :class:`PermanentError` (``unknown_model_profile``)."""
    try:
        return PROFILES[name]
    except KeyError:
        raise PermanentError(f"unknown model profile {name!r}; known: {sorted(PROFILES)}",
                             code="unknown_model_profile") from None


def get_prompt(version: str) -> str:
    """The system prompt of ``version``.

    Raises :class:`PermanentError` with code ``unknown_prompt_version``.
    """
    try:
        return PROMPTS[version]
    except KeyError:
        raise PermanentError(f"unknown prompt version {version!r}; known: {sorted(PROMPTS)}",
                             code="unknown_prompt_version") from None
