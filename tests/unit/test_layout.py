"""The layout tells the story of the code: every stage of the pipeline definition has its
module in streams/, schemas/ stands alone, and core modules do not reach into the example
downstream. Checked on the import statements themselves (function-level ones included)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

from schemas.pipeline import PIPELINE

ROOT = Path(__file__).parents[2]


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any level of the file."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_every_stage_has_its_module_in_streams() -> None:
    for stage in PIPELINE.stages:
        module = importlib.import_module(f"streams.{stage.name}")
        assert callable(module.register), stage.name
        if stage is not PIPELINE.stages[0]:  # intake creates the job: no claim, no work()
            assert callable(module.work), stage.name
        for lane in stage.lanes:
            assert callable(getattr(module, f"register_{lane}")), (stage.name, lane)


def test_nothing_imports_the_old_stage_module() -> None:
    assert not (ROOT / "jobstream" / "stages.py").exists()
    offenders = [str(p.relative_to(ROOT)) for folder in ("jobstream", "streams", "schemas",
                                                         "consumers", "outbox_relay", "bench",
                                                         "tests")
                 for p in (ROOT / folder).rglob("*.py")
                 if any(m == "jobstream.stages" or m.startswith("jobstream.stages.")
                        for m in _imports(p))]
    assert not offenders, offenders


def test_schemas_import_nothing_from_jobstream() -> None:
    offenders = {str(p.relative_to(ROOT)): sorted(m for m in _imports(p)
                                                  if m.split(".")[0] in ("jobstream", "streams"))
                 for p in (ROOT / "schemas").rglob("*.py")}
    assert not {k: v for k, v in offenders.items() if v}


def test_core_metrics_do_not_import_the_example_downstream() -> None:
    for core in ("metrics.py", "health.py"):
        bad = sorted(m for m in _imports(ROOT / "jobstream" / core)
                     if m.startswith(("examples", "jobstream.ready_applier")))
        assert not bad, (core, bad)
