"""PromQL helpers for the tests of ops/: which series an expression names, and whether
promtool parses it."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from ruamel.yaml import YAML

OPS = Path(__file__).parents[1] / "ops"
ALERTS = OPS / "prometheus" / "alerts.yml"
ALERT_TESTS = OPS / "prometheus" / "alerts_test.yml"
DASHBOARDS = OPS / "grafana" / "dashboards"

#: Words of PromQL that are not series names (binary operators, modifiers, literals).
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", "Inf", "NaN"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring)\s*\([^)]*\)"
                       r"|\b(?:group_left|group_right)\b(?:\s*\([^)]*\))?")


def promtool() -> str:
    """The promtool binary (Debian's ``prometheus`` package). Fails the test when absent:
    .ci/run and scripts/test.sh install it."""
    path = shutil.which("promtool")
    assert path, "promtool is missing: apt-get install -y prometheus (scripts/test.sh does)"
    return path


def series_names(expr: str) -> set[str]:
    """The series (metric names, recording rules) an expression selects: every identifier
    outside strings, label matchers, range brackets and grouping clauses that is not a
    function or aggregation (followed by ``(``) nor a keyword."""
    e = _STRING.sub('""', expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = _GROUPING.sub(" ", e)
    names = set()
    for m in re.finditer(r"(?<![0-9.])[A-Za-z_:][A-Za-z0-9_:]*", e):
        if e[m.end():].lstrip().startswith("(") or m.group(0) in _KEYWORDS:
            continue
        names.add(m.group(0))
    return names


def check_parses(exprs: dict[str, str], tmp: Path) -> subprocess.CompletedProcess[str]:
    """Run ``promtool check rules`` on a rules file holding each expression as a recording
    rule (``name -> expr``): promtool parses every expression with Prometheus' own parser."""
    rules = {"groups": [{"name": "check", "rules": [
        {"record": f"check:expr_{i}", "expr": e} for i, e in enumerate(exprs.values())]}]}
    path = tmp / "exprs.yml"
    with path.open("w") as fh:
        YAML().dump(rules, fh)
    return subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True,
                          text=True, timeout=60)


def alert_rules() -> list[dict]:  # type: ignore[type-arg]
    """Every rule of alerts.yml (alerts and recording rules)."""
    doc = YAML(typ="safe").load(ALERTS.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def panel_exprs() -> dict[str, str]:
    """``"<dashboard>: <panel title> [refId]" -> expr`` of every dashboard panel target."""
    import json
    out = {}
    for path in sorted(DASHBOARDS.glob("*.json")):
        dash = json.loads(path.read_text())
        panels = list(dash["panels"])
        for p in list(panels):
            panels += p.get("panels", [])
        for p in panels:
            for t in p.get("targets", []):
                out[f"{path.name}: {p['title']} [{t['refId']}]"] = t["expr"]
    return out
