"""``jobstream submit`` on a mix of good and failing documents: the bar counts finished jobs,
a summary table names the failures with their stage and error code, the exit code is 1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from jobstream.settings import Settings
from tests.helpers import ProcessRunner, query

pytestmark = pytest.mark.e2e

LICENSES = Path("/usr/share/common-licenses")


def test_submit_mixed_documents_prints_a_summary_and_exits_1(
        procs: ProcessRunner, settings: Settings, tmp_path: Path) -> None:
    url, _ = procs.start_api({"tok": "acme"})
    procs.pipeline()
    good = [LICENSES / "BSD", LICENSES / "MIT"] if (LICENSES / "MIT").exists() \
        else [LICENSES / "BSD", LICENSES / "Apache-2.0"]
    bad = []
    for i in range(2):  # a PDF that cannot be parsed fails at text extraction
        p = tmp_path / f"broken-{i}.pdf"
        p.write_bytes(b"%PDF-1.4\n" + f"not really a pdf {i}\n".encode() * 20)
        bad.append(p)
    r = subprocess.run([sys.executable, "-m", "jobstream.cli", "submit",
                        *map(str, good + bad)],
                       env=procs.env(JOBSTREAM_API_URL=url, JOBSTREAM_API_TOKEN="tok",
                                     COLUMNS="220"),
                       capture_output=True, text=True, timeout=300)
    out = r.stdout
    assert r.returncode == 1, out + r.stderr
    lines = out.splitlines()
    # the per-job table: the failed jobs at the stage that failed, with the error code
    failed_rows = [ln for ln in lines if "broken-" in ln and "failed" in ln]
    assert len(failed_rows) == 2, out
    assert all("extract" in ln and "unparseable_document" in ln for ln in failed_rows)
    # the summary table
    summary = out[out.index("4 jobs"):]
    row = {ln.split("│")[1].strip(): [c.strip() for c in ln.split("│")[2:-1]]
           for ln in summary.splitlines() if ln.count("│") >= 4}
    assert row["succeeded"][0] == "2", summary
    assert row["failed"][0] == "2", summary
    assert row["failed"][1] == "unparseable_document at extract ×2", summary
    assert row["cancelled"][0] == "0", summary
    assert "jobs finished" in out + r.stderr  # the bar counts jobs, failed ones included
    jobs = query(settings.database_url, "SELECT status, current_stage, error_code FROM job "
                 "WHERE tenant_id = 'acme' ORDER BY status")
    assert [(j["status"], j["current_stage"]) for j in jobs] == [
        ("failed", "extract"), ("failed", "extract"),
        ("succeeded", "publish"), ("succeeded", "publish")]

    ok = subprocess.run([sys.executable, "-m", "jobstream.cli", "submit", str(good[0])],
                        env=procs.env(JOBSTREAM_API_URL=url, JOBSTREAM_API_TOKEN="tok",
                                      COLUMNS="220"),
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stdout + ok.stderr  # every job succeeded: exit 0

    # A batch of the same documents (new keys): the succeeded one is reused, the failed one
    # starts a new run (which fails again); the batch ends with the same summary and exit 1.
    b = subprocess.run([sys.executable, "-m", "jobstream.cli", "batch", str(good[1]),
                        str(bad[0])],
                       env=procs.env(JOBSTREAM_API_URL=url, JOBSTREAM_API_TOKEN="tok",
                                     COLUMNS="220"),
                       capture_output=True, text=True, timeout=300)
    assert b.returncode == 1, b.stdout + b.stderr
    assert "succeeded 1, failed 1" in b.stdout, b.stdout
    assert "unparseable_document at extract" in b.stdout, b.stdout
    runs = query(settings.database_url, "SELECT generation FROM job WHERE tenant_id = 'acme' "
                 "AND filename = %s", (bad[0].name,))
    assert runs[0]["generation"] >= 1  # a new run of the failed job, not its old failure
