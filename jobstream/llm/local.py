"""The ``local`` model: a deterministic, offline, extractive analyser behind the OpenAI API.

It is served as an httpx transport, so the provider client runs exactly the same request and
response code path (``POST /v1/chat/completions``) as with OpenAI, vLLM or Ollama. The summary is
extractive, after H. P. Luhn, "The Automatic Creation of Literature Abstracts" (IBM J. Res. Dev.,
1958): sentences are scored by the frequency of their significant words. Tokens are counted as
whitespace-separated words (the local model has no tokenizer; it costs nothing).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from typing import Any

import httpx

STOPWORDS = frozenset(
    """
a about above after again against all also am an and any are as at be because been before being
below between both but by can could did do does doing down during each either few for from
further had has have having he her here hers him his how i if in into is it its itself just may
me might more most must my no nor not now of off on once only or other our out over own same
shall she should so some such than that the their them then there these they this those through
to too under until up upon us very was we were what when where which while who whom why will
with would you your yours one two any such shall section license licence software program work
works terms
"""  # noqa: SIM905
    .split()
)

_WORD = re.compile(r"[A-Za-z][A-Za-z'-]{2,}")
_SENT = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"(])")


def analyse(text: str, max_keywords: int = 8, max_sentences: int = 2) -> dict[str, Any]:
    """Extractive analysis of ``text``: title candidate, summary, keywords, counts, fields."""
    words = [w.lower() for w in _WORD.findall(text)]
    freq = Counter(w for w in words if w not in STOPWORDS)
    keywords = [w for w, _ in sorted(freq.items(), key=lambda kv: (-kv[1], kv[0]))[:max_keywords]]
    flat = " ".join(text.split())
    sentences = [s.strip() for s in _SENT.split(flat) if len(s.split()) >= 4]
    def score(s: str) -> float:
        sig = [w.lower() for w in _WORD.findall(s) if w.lower() in freq]
        return sum(freq[w] for w in sig) / (len(s.split()) + 5)
    top = sorted(range(len(sentences)), key=lambda i: (-score(sentences[i]), i))[:max_sentences]
    summary = " ".join(sentences[i][:400] for i in sorted(top)) or flat[:400]
    first_line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    fields: dict[str, Any] = {}
    if m := re.search(r"\bVersion\s+(\d+(?:\.\d+)*)", text, flags=re.I):
        fields["version"] = m.group(1)
    if years := sorted(set(re.findall(r"\b(?:19|20)\d\d\b", text))):
        fields["years"] = years[:10]
    if urls := sorted(set(u.rstrip(".,;)>") for u in re.findall(r"https?://[^\s<>\"]+", text))):
        fields["urls"] = urls[:10]
    if emails := sorted(set(re.findall(r"\b[\w.+-]+@[\w-]+\.[\w.-]+\b", text))):
        fields["emails"] = emails[:10]
    return {
        "title": first_line[:200] if 0 < len(first_line) <= 120 else None,
        "summary": summary,
        "keywords": keywords or ["text"],
        "word_count": len(text.split()),
        "fields": fields,
    }


def chat_completion(request: dict[str, Any], model: str) -> dict[str, Any]:
    """Answer one OpenAI chat-completions request body with the local analyser."""
    messages = request.get("messages") or []
    user = next((m.get("content", "") for m in reversed(messages) if m.get("role") == "user"), "")
    prompt = " ".join(str(m.get("content", "")) for m in messages)
    content = json.dumps(analyse(str(user)), sort_keys=True)
    prompt_tokens, completion_tokens = len(prompt.split()), len(content.split())
    return {
        "id": "local-" + hashlib.sha256(content.encode()).hexdigest()[:16],
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": content}}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


class LocalModelTransport(httpx.BaseTransport):
    """httpx transport that serves ``POST …/chat/completions`` with :func:`chat_completion`."""

    def __init__(self, model: str) -> None:
        self.model = model

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        """Answer 200 with a chat completion, 404 for other paths, 400 for a bad body."""
        if request.method != "POST" or not request.url.path.endswith("/chat/completions"):
            return httpx.Response(404, json={"error": {"message": "not found"}})
        try:
            body = json.loads(request.read())
        except json.JSONDecodeError:
            return httpx.Response(400, json={"error": {"message": "body is not JSON"}})
        return httpx.Response(200, json=chat_completion(body, self.model))
