"""The README's main command, end to end: ``jobstream demo`` on the real licence texts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jobstream.settings import Settings
from tests.helpers import ProcessRunner, query

pytestmark = pytest.mark.e2e


def test_demo_processes_every_licence_and_pdf_and_checks_exactly_once(
        settings: Settings, procs: ProcessRunner) -> None:
    r = subprocess.run([sys.executable, "-m", "jobstream.cli", "demo", "--no-services",
                        "--tenant", "demo-e2e", "--timeout", "300"],
                       env=procs.env(COLUMNS="160"), capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "CHECK PASSED" in r.stdout
    # No raw librdkafka log lines (%<level>|<time>|<FACILITY>|...) between the progress bars.
    import re
    raw = re.compile(r"^%\d\|\d+\.\d+\|[A-Z]+\|", re.M)
    assert not raw.search(r.stdout) and not raw.search(r.stderr), r.stderr[-2000:]
    jobs = query(settings.database_url,
                 "SELECT status, content_type FROM job WHERE tenant_id = 'demo-e2e'")
    requests = query(settings.database_url,
                     "SELECT count(*) AS n FROM job_request WHERE tenant_id = 'demo-e2e'")
    assert requests[0]["n"] == 20  # 17 licence texts + 3 PDFs
    assert len(jobs) == 17  # GPL/GPL-3, LGPL/LGPL-3, GFDL/GFDL-1.3 are the same bytes
    assert all(j["status"] == "succeeded" for j in jobs)
    assert sum(j["content_type"] == "application/pdf" for j in jobs) == 3
    applied = query(settings.database_url,
                    "SELECT dedup_key, count(*) AS n FROM downstream.document_analysis "
                    "WHERE tenant_id = 'demo-e2e' GROUP BY dedup_key")
    assert len(applied) == 17 and all(a["n"] == 1 for a in applied)
