"""The provider client against a real fake provider over HTTP on loopback (no monkeypatch)."""

from __future__ import annotations

import httpx
import pytest

from jobstream.drills.fake_provider import FakeProvider
from jobstream.errors import OutcomeUnknown, PermanentError, RetryableError
from jobstream.llm.client import ProviderClient
from jobstream.llm.profiles import get_profile


def _client(fp: FakeProvider, timeout_s: float = 5.0) -> ProviderClient:
    return ProviderClient(get_profile("custom"), timeout_s=timeout_s, base_url=fp.base_url)


@pytest.fixture
def fake():
    with FakeProvider() as fp:
        yield fp


def test_normal_answer_is_a_parsed_json_object(fake: FakeProvider) -> None:
    c = _client(fake)
    got = c.complete("sys", "The quick brown fox jumps over the lazy dog twice in 2024.",
                     idempotency_key="j:0")
    c.close()
    assert got.status_code == 200 and got.content["fields"]["years"] == ["2024"]
    assert fake.snapshot()["by_key"] == {"j:0": 1}


@pytest.mark.parametrize("behaviour,exc,code", [
    ({"status": 429, "retry_after": "3"}, RetryableError, "rate_limited"),
    ({"status": 503}, RetryableError, "http_503"),
    ({"status": 400}, PermanentError, "http_400"),
    ({"malformed": True}, PermanentError, "malformed_answer"),
    ({"refuse": True}, PermanentError, "content_refused"),
])
def test_fault_classification(fake: FakeProvider, behaviour: dict, exc: type, code: str) -> None:
    fake.set_script({"sequence": [behaviour]})
    c = _client(fake)
    with pytest.raises(exc) as info:
        c.complete("sys", "text text text text")
    c.close()
    assert info.value.code == code
    if behaviour.get("retry_after"):
        assert info.value.retry_after_s == 3.0


def test_timeout_after_sending_is_outcome_unknown_not_failure(fake: FakeProvider) -> None:
    fake.set_script({"sequence": [{"hang_s": 2}]})
    c = _client(fake, timeout_s=0.5)
    with pytest.raises(OutcomeUnknown):
        c.complete("sys", "text")
    c.close()
    assert fake.snapshot()["total"] == 1  # the request did reach the provider


def test_unreachable_provider_is_transient() -> None:
    fp = FakeProvider()
    url = fp.base_url
    fp.stop()  # bound, then closed: nothing listens there now
    c = ProviderClient(get_profile("custom"), timeout_s=2, base_url=url)
    with pytest.raises(RetryableError) as info:
        c.complete("sys", "text")
    c.close()
    assert info.value.code == "connect_error"


def test_control_endpoints_over_http(fake: FakeProvider) -> None:
    root = fake.base_url.removesuffix("/v1")
    httpx.put(f"{root}/_control/script", json={"default": {"status": 503}})
    r = httpx.post(f"{fake.base_url}/chat/completions", json={"messages": []})
    assert r.status_code == 503
    assert httpx.get(f"{root}/_control/calls").json()["statuses"] == {"503": 1}


def test_put_script_keeps_the_call_counters_and_reset_zeroes_them(fake: FakeProvider) -> None:
    root = fake.base_url.removesuffix("/v1")
    for _ in range(2):
        httpx.post(f"{fake.base_url}/chat/completions", json={"messages": []},
                   headers={"Idempotency-Key": "k"})
    r = httpx.put(f"{root}/_control/script", json={"default": {"status": 503}})
    assert r.status_code == 200
    httpx.post(f"{fake.base_url}/chat/completions", json={"messages": []},
               headers={"Idempotency-Key": "k"})
    calls = httpx.get(f"{root}/_control/calls").json()
    assert calls["total"] == 3 and calls["by_key"] == {"k": 3}
    assert calls["statuses"] == {"200": 2, "503": 1}
    httpx.post(f"{root}/_control/reset")
    assert httpx.get(f"{root}/_control/calls").json()["total"] == 0
