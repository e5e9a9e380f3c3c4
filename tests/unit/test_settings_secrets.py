"""Secrets in settings (issue 9, row 11): SecretStr everywhere they live, masked where printed,
revealed only where a connection or a child process needs them."""

from __future__ import annotations

import json
import subprocess
import sys

from pydantic import SecretStr

from bench.common import subprocess_env
from jobstream.drills.chaos import settings_env
from jobstream.settings import Settings, masked_database_url

DSN = "postgresql://jobstream:hunter2@db.example:5432/jobstream"


def _settings() -> Settings:
    return Settings(database_url=DSN, api_tokens={"tok-one-secret": "acme",
                                                  "tok-two-secret": "other"},
                    provider_api_key="sk-secret-key")


def test_secrets_are_secretstr_and_masked_in_repr_and_public_dump() -> None:
    s = _settings()
    assert isinstance(s.database_dsn, SecretStr) and isinstance(s.provider_api_key, SecretStr)
    assert all(isinstance(k, SecretStr) for k in s.api_tokens)
    for text in (repr(s), str(s), json.dumps(s.public_dump(), default=str)):
        for secret in ("hunter2", "tok-one-secret", "tok-two-secret", "sk-secret-key"):
            assert secret not in text, (secret, text[:300])
    assert sorted(s.public_dump()["api_tokens"].values()) == ["acme", "other"]


def test_every_user_of_the_database_url_still_gets_it() -> None:
    s = _settings()
    assert s.database_url == DSN  # Store, migrate, tests: the property reveals it
    moved = s.model_copy(update={"database_url": DSN.replace("/jobstream", "/other"),
                                 "topic_prefix": "x."})  # chaos's scratch databases
    assert moved.database_url.endswith("/other") and moved.topic_prefix == "x."
    assert s.database_url == DSN
    for env in (settings_env(s), subprocess_env(s), s.to_env()):  # chaos, bench, children
        assert env["JOBSTREAM_DATABASE_URL"] == DSN
        assert json.loads(env["JOBSTREAM_API_TOKENS"]) == {"tok-one-secret": "acme",
                                                           "tok-two-secret": "other"}
        assert env["JOBSTREAM_PROVIDER_API_KEY"] == "sk-secret-key"
    assert Settings(_env_file=None, **{"database_dsn": DSN}).database_url == DSN


def test_jobstream_config_prints_no_token_key_or_password() -> None:
    env = {"PATH": "/usr/bin:/bin", "JOBSTREAM_DATABASE_URL": DSN,
           "JOBSTREAM_API_TOKENS": json.dumps({"tok-one-secret": "acme"}),
           "JOBSTREAM_PROVIDER_API_KEY": "sk-secret-key"}
    r = subprocess.run([sys.executable, "-m", "jobstream.cli", "config"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for secret in ("hunter2", "tok-one-secret", "sk-secret-key"):
        assert secret not in r.stdout + r.stderr
    assert "acme" in r.stdout
    # which database is in use, without its password
    assert "database_dsn = postgresql://jobstream:**********@" in r.stdout
    assert masked_database_url("host=db port=5 dbname=x user=u password=hunter2") == \
        "postgresql://u:**********@db:5/x"
    assert masked_database_url("not a url ' = ") == "**********"
