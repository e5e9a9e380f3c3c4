"""OpenAI-compatible chat-completions client over httpx, with one error taxonomy and a budget.

Classification (design.md, "Stage work"):

- transient -> :class:`RetryableError`: HTTP 429 (honours ``Retry-After``, RFC 9110 §10.2.3,
  seconds or HTTP-date), 500/502/503/504, connection errors before the request was sent;
- permanent -> :class:`PermanentError`: other 4xx (400 bad request, 401/403 key, 404 model),
  content refusal, a 2xx whose body is not a chat completion with a JSON object answer;
- a timeout after the request was sent -> :class:`OutcomeUnknown` (the provider may have done the
  work and billed it).

:func:`backoff_s` is "full jitter" exponential backoff (M. Brooker, "Exponential Backoff And
Jitter", AWS Architecture Blog, 2015): ``uniform(0, min(cap, base * 2**attempt))``.
Retrying is the caller's (``streams.llm``), because every attempt is recorded and fenced.
"""

from __future__ import annotations

import email.utils
import json
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import httpx

from jobstream.errors import JobstreamError, OutcomeUnknown, PermanentError, RetryableError
from jobstream.llm.local import LocalModelTransport
from jobstream.llm.profiles import ModelProfile


@dataclass(frozen=True)
class Completion:
    """A successful answer: the parsed JSON object, token usage, HTTP status, latency (ms)."""

    content: dict[str, Any]
    prompt_tokens: int
    completion_tokens: int
    status_code: int
    latency_ms: float


class CallCancelled(JobstreamError):
    """An in-flight provider call was aborted because its job was cancelled."""

    code = "external_call_cancelled"


def backoff_s(attempt: int, base_s: float, cap_s: float, rng: random.Random | None = None) -> float:
    """Full-jitter backoff for retry number ``attempt`` (0-based), in seconds."""
    return (rng or random).uniform(0.0, min(cap_s, base_s * (2 ** attempt)))


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """``Retry-After`` header -> seconds to wait (>= 0), or ``None`` if absent or unparseable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError):
        return None
    return max(0.0, when - (now if now is not None else time.time()))


class ProviderClient:
    """One profile's client. ``complete()`` makes exactly one HTTP request (no hidden retries).

    ``timeout_s``: whole-request timeout (seconds). Thread-safe (one ``httpx.Client``).
    """

    def __init__(self, profile: ModelProfile, *, timeout_s: float, base_url: str | None = None,
                 api_key: str | None = None) -> None:
        self.profile = profile
        self.model = profile.model
        url = base_url or profile.base_url
        self._local = url is None
        headers = {"Content-Type": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        if url is None:
            self._http = httpx.Client(base_url="http://local-model/v1", headers=headers,
                                      transport=LocalModelTransport(profile.model),
                                      timeout=timeout_s)
        else:
            self._http = httpx.Client(base_url=url.rstrip("/"), headers=headers,
                                      timeout=timeout_s)

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def complete(self, system: str, user: str, *, idempotency_key: str | None = None,
                 should_abort: Callable[[], bool] | None = None,
                 abort_poll_s: float = 0.5) -> Completion:
        """Send one chat completion asking for a JSON object.

        ``should_abort``: polled every ``abort_poll_s`` seconds while the request is in flight;
        when it returns True the connection is closed and :class:`CallCancelled` is raised
        (the provider may still have done the work). Raises :class:`RetryableError` (with
        ``retry_after_s``), :class:`PermanentError` or :class:`OutcomeUnknown`, classified as
        the module docstring says.
        """
        if should_abort is None:
            return self._complete(self._http, system, user, idempotency_key)
        # An abortable call gets its own connection, so closing it cannot hurt other calls.
        http = httpx.Client(base_url=self._http.base_url, headers=self._http.headers,
                            timeout=self._http.timeout, transport=self._transport())
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            fut = pool.submit(self._complete, http, system, user, idempotency_key)
            while True:
                try:
                    return fut.result(timeout=abort_poll_s)
                except FutureTimeout:
                    if should_abort():
                        http.close()
                        raise CallCancelled("in-flight provider call aborted") from None
        finally:
            pool.shutdown(wait=False)
            http.close()

    def _transport(self) -> httpx.BaseTransport | None:
        return LocalModelTransport(self.model) if self.profile.base_url is None and \
            self._local else None

    def _complete(self, http: httpx.Client, system: str, user: str,
                  idempotency_key: str | None) -> Completion:
        body = {
            "model": self.model,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "temperature": 0,
            "response_format": {"type": "json_object"},
        }
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        started = time.perf_counter()
        try:
            resp = http.post("/chat/completions", json=body, headers=headers)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            raise RetryableError(f"provider unreachable: {exc!r}", code="connect_error") from None
        except httpx.TimeoutException as exc:
            raise OutcomeUnknown(f"no answer within the timeout: {exc!r}") from None
        except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
            raise OutcomeUnknown(f"connection lost after sending: {exc!r}") from None
        latency_ms = (time.perf_counter() - started) * 1000
        status = resp.status_code
        if status == 429:
            raise RetryableError("provider rate limit (429)", code="rate_limited",
                                 retry_after_s=parse_retry_after(resp.headers.get("retry-after")))
        if status in (500, 502, 503, 504):
            raise RetryableError(f"provider unavailable ({status})", code=f"http_{status}",
                                 retry_after_s=parse_retry_after(resp.headers.get("retry-after")))
        if status >= 400:
            raise PermanentError(f"provider rejected the request ({status}): {resp.text[:300]}",
                                 code=f"http_{status}")
        try:
            data = resp.json()
            choice = data["choices"][0]
            if choice.get("finish_reason") == "content_filter":
                raise PermanentError("provider refused the content", code="content_refused")
            content = json.loads(choice["message"]["content"])
            if not isinstance(content, dict):
                raise ValueError("answer is not a JSON object")
            usage = data.get("usage") or {}
            return Completion(content, int(usage.get("prompt_tokens", 0)),
                              int(usage.get("completion_tokens", 0)), status, latency_ms)
        except PermanentError:
            raise
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise PermanentError(f"malformed provider answer: {exc!r}",
                                 code="malformed_answer") from None
