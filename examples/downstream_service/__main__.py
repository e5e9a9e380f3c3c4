"""``python -m examples.downstream_service [migrate|run|gc HORIZON_S]`` (default: migrate,
then run until SIGTERM/SIGINT)."""

from __future__ import annotations

import logging
import sys

from examples.downstream_service.service import build, migrate, settings_from_env


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    settings = settings_from_env()
    cmd = argv[0] if argv else "serve"
    if cmd in ("migrate", "serve"):
        migrate(settings)
    if cmd in ("run", "serve"):
        stats = build(settings).run_forever()
        print(f"stopped: applied={stats.applied} duplicates={stats.duplicates} "
              f"dead_lettered={stats.dead_lettered}", flush=True)
    elif cmd == "gc":
        print(f"deleted {build(settings).gc(float(argv[1]))} processed_event rows")
    elif cmd != "migrate":
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
