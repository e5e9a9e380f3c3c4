"""docker-compose.yml is a valid compose file and runs what the code can run (no Docker engine:
the file is validated against the compose specification's JSON Schema, which check-jsonschema
ships as ``vendor.compose-spec``)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from ruamel.yaml import YAML

from jobstream.cli import main as cli
from jobstream.settings import Settings

COMPOSE = Path(__file__).parents[2] / "docker-compose.yml"


def _validate(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema",
                           "vendor.compose-spec", str(path)], capture_output=True, text=True,
                          timeout=60)


def _compose() -> dict[str, Any]:
    return YAML(typ="safe").load(COMPOSE.read_text())


def test_compose_file_is_valid_against_the_compose_spec() -> None:
    r = _validate(COMPOSE)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("broken", [
    "services:\n  a:\n    image: [x]\n",                                   # not a string
    "services:\n  a:\n    image: x\n    depends_on:\n      b:\n        condition: ready\n",
    "services:\n  a:\n    image: x\n    portz: ['80:80']\n",                # unknown key
])
def test_the_validator_rejects_a_broken_compose_file(tmp_path: Path, broken: str) -> None:
    path = tmp_path / "compose.yml"
    path.write_text(broken)
    assert _validate(path).returncode != 0


def _env_names(doc: dict[str, Any]) -> set[str]:
    names: set[str] = set()
    for svc in doc["services"].values():
        env = svc.get("environment") or {}
        names |= set(env) if isinstance(env, dict) else {e.split("=", 1)[0] for e in env}
    return names


def test_services_run_existing_commands_with_known_settings() -> None:
    doc = _compose()
    commands = set(cli.commands)
    ours = {n: s for n, s in doc["services"].items() if s.get("image") == "jobstream:dev"}
    assert {"init", "relay", "worker-interactive", "worker-batch", "api",
            "downstream"} <= set(ours)
    for name, svc in ours.items():
        words = " ".join(svc["command"]).split()
        used = [words[i + 1] for i, w in enumerate(words[:-1]) if w == "jobstream"]
        assert used and all(u in commands for u in used), (name, used)
    fields = set(Settings().to_env()) | {f"JOBSTREAM_{f.upper()}" for f in Settings.model_fields}
    unknown = {n for n in _env_names(doc) if n.startswith("JOBSTREAM_")} - fields
    assert not unknown, unknown


def test_topics_are_created_at_start_up_with_configurable_partitions() -> None:
    doc = _compose()
    init = doc["services"]["init"]
    assert "jobstream topics" in " ".join(init["command"])
    assert "jobstream migrate" in " ".join(init["command"])
    assert re.fullmatch(r"\$\{JOBSTREAM_TOPIC_PARTITIONS:-\d+\}",
                        init["environment"]["JOBSTREAM_TOPIC_PARTITIONS"])
    # The broker never creates a topic on its own, so partitions come from init alone ...
    assert doc["services"]["kafka"]["environment"]["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"
    # ... and every jobstream service starts after init succeeded, with the same setting.
    for name in ("relay", "worker-interactive", "worker-batch", "api", "downstream"):
        svc = doc["services"][name]
        assert svc["depends_on"]["init"]["condition"] == "service_completed_successfully"
        assert (svc["environment"]["JOBSTREAM_TOPIC_PARTITIONS"]
                == init["environment"]["JOBSTREAM_TOPIC_PARTITIONS"])


#: The Postgres settings both ways of running the services pass (scripts/services.sh's generated
#: ``jobstream.conf`` and the compose file's ``postgres -c``): the WAL settings of perf-pg9
#: (bench/README.md "Postgres WAL and CPU per job") and logical decoding for Debezium.
PG_SETTINGS = ("wal_level", "max_replication_slots", "wal_compression", "checkpoint_timeout",
               "max_wal_size")


def _services_sh_pg_settings() -> dict[str, str]:
    script = (COMPOSE.parent / "scripts" / "services.sh").read_text()
    conf = script.split("write_pg_config() {", 1)[1].split("\nEOF\n", 1)[0]
    found = dict(re.findall(r"^(\w+) = '?([^'\n]*?)'?$", conf, re.MULTILINE))
    return {k: found[k] for k in PG_SETTINGS if k in found}


def test_compose_postgres_has_the_settings_of_services_sh() -> None:
    words = _compose()["services"]["postgres"]["command"]
    flags = dict(w.split("=", 1) for i, w in enumerate(words) if i and words[i - 1] == "-c")
    ours = _services_sh_pg_settings()
    assert set(ours) == set(PG_SETTINGS)  # every setting is in the generated jobstream.conf
    assert {k: flags.get(k) for k in PG_SETTINGS} == ours
    assert ours["wal_compression"] == "lz4"
