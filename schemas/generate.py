"""Generate the committed JSON Schema files from the pydantic models.

``python -m schemas.generate`` writes ``schemas/json/<event_type>.v<N>.schema.json`` and the
AsyncAPI document ``schemas/asyncapi.json`` (``schemas.asyncapi``); ``--check`` exits 1 when a
committed file differs from what the models generate (drift).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from schemas.events import EVENT_MODELS, SCHEMA_VERSION

OUT_DIR = Path(__file__).parent / "json"


def render() -> dict[str, str]:
    """File name -> JSON text for every event type (deterministic: sorted keys, trailing \\n)."""
    files: dict[str, str] = {}
    for event_type, model in EVENT_MODELS.items():
        schema = model.model_json_schema(mode="serialization")
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        schema["$id"] = f"urn:jobstream:event:{event_type}:v{SCHEMA_VERSION}"
        name = f"{event_type}.v{SCHEMA_VERSION}.schema.json"
        files[name] = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    return files


def main(argv: list[str] | None = None) -> int:
    """Write (or with ``--check`` compare) the schema files; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if committed files drifted")
    args = parser.parse_args(argv)
    files = render()
    drift = []
    for name, text in files.items():
        path = OUT_DIR / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                drift.append(name)
        else:
            OUT_DIR.mkdir(exist_ok=True)
            path.write_text(text)
    stale = sorted(p.name for p in OUT_DIR.glob("*.schema.json") if p.name not in files)
    if args.check and (drift or stale):
        print(f"schema drift: changed={drift} stale={stale}; run python -m schemas.generate",
              file=sys.stderr)
        return 1
    for name in stale if not args.check else []:
        (OUT_DIR / name).unlink()
    from schemas import asyncapi  # the AsyncAPI document is generated from the same models
    rc = asyncapi.main(["--check"] if args.check else [])
    if rc == 0:
        print(f"{len(files)} JSON Schema files and the AsyncAPI document "
              + ("match the event models" if args.check else f"written to {OUT_DIR}"))
    return rc


if __name__ == "__main__":
    sys.exit(main())
