"""Two consumer groups on one ``job.ready`` topic, hostile messages among good ones (helper-49's
report-only probe of session 8, /work/wt/adv8-probes/, committed).

Group A is ``consume-ready`` (the example downstream); group B is the consumer library
(``two_groups_consumer.py``, two members). The first member of B stops itself (SIGSTOP) at a
chosen point of its first batch; the second takes the partitions over once the first one's
Kafka session (6 s) expires and works through everything; then the first is resumed (SIGCONT)
and works through its stale batch before its client notices the lost assignment.

Each group must dead-letter exactly the bad positions, each under its own name
(``dlq_consumer_group``), one marker row per position in its own ``processed_event``, and
``dlq replay --dry-run --group`` must list each group's records. The resumed member meets the
positions its successor marked and sends none of them again: it logs "<position> was
dead-lettered before by group ...; not again" (``IdempotentConsumer._dead_letter``).

The pause points are chosen outside a DLQ produce: inside the batch's apply transaction, and
between two dead letters (after the first is durable, before the next begins). There no
position may come twice. The one documented window, a member paused INSIDE a DLQ produce for
longer than the dead letter's idle limit (at least 20 s: ``2 x (dlq_produce_timeout_s + 5) +
10``), can add one second record of that one position (docs/design-notes.md); it is probed by
``test_break_consumer_dead_letter_paused.py``. helper-49's run paused there by chance (the
SIGSTOP came right after B's first apply, when B sends its dead letters) and waited ~43 s.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psycopg
import pytest

from consumers import create_tables
from jobstream.kafka import group_lag
from jobstream.settings import Settings
from schemas.events import encode_event
from tests.helpers import (
    ProcessRunner,
    ScriptRig,
    job_ready,
    processed_rows,
    produce_at,
    read_topic,
    stopped,
    wait_for,
)

pytestmark = pytest.mark.e2e

SCHEMA = "two_groups"
SCRIPT = Path(__file__).with_name("two_groups_consumer.py")
N, PARTITIONS = 300, 3
HOSTILE = [(None, None), (b"k", b"not json"), (b"k", b"\xff\xfe bad utf8 \x80"),
           (b"k", b'{"event_type": "job.ready"}'), (b"k", b"[1]"), (b"\xff\x00", b"null")]
NOT_AGAIN = "was dead-lettered before by group"
STALE_DONE = "is no longer assigned; offset"  # consumers/idempotent.py _store_offset

Position = tuple[int, int]


def _two_groups(settings: Settings, procs: ProcessRunner, tmp_path: Path, freeze: str
                ) -> tuple[dict[str, collections.Counter[Position]], set[Position], str, str,
                           str]:
    """Run the probe with B's first member frozen at ``freeze`` (``apply`` or ``between``,
    see the script). Returns (group -> DLQ records per original position, the bad positions,
    group A, group B, the resumed member's log)."""
    url, topic = settings.database_url, settings.topic("job.ready")
    with psycopg.connect(url) as conn:
        create_tables(conn, SCHEMA)
    parts: list[tuple[int, bytes, bytes]] = []
    bad_at: list[int] = []  # indexes into parts of the bad messages
    for i in range(N):
        e = job_ready(f"tg{i}")
        parts.append((i % PARTITIONS, str(e.job_id).encode(), encode_event(e)))
        if i % 10 == 0:  # ~10 bad messages in every batch of 100
            k, v = HOSTILE[(i // 10) % len(HOSTILE)]
            bad_at.append(len(parts))
            parts.append((i % PARTITIONS, k, v))  # a None key or value: hostile
    produce_at(settings, topic, parts)
    # produce_at waits for each ack in order: per partition, offsets follow the order given
    offsets: collections.Counter[int] = collections.Counter()
    hostile: set[Position] = set()
    for j, (p, _k, _v) in enumerate(parts):
        if j in bad_at:
            hostile.add((p, offsets[p]))
        offsets[p] += 1
    ga, gb = settings.group("downstream-ready-applier"), settings.group("two-groups-b")
    procs.start("consume-ready", name="group-a", JOBSTREAM_CONSUMER_SESSION_TIMEOUT_MS="6000",
                JOBSTREAM_CONSUMER_BATCH_SIZE="100",
                JOBSTREAM_CONSUMER_TRANSACTION_IDLE_TIMEOUT_S="3")
    rig = ScriptRig(tmp_path, SCRIPT.read_text(), [
        settings.kafka_bootstrap_servers, url, settings.topic_prefix, gb, SCHEMA],
        ("b-paused", "b-next"))
    try:
        first = rig.start("b-paused", FREEZE=freeze)
        wait_for(lambda: f"FREEZING {freeze}" in rig.log("b-paused"), 60,
                 f"B's first member to freeze ({freeze})", rig.all_logs, every_s=0.1)
        wait_for(lambda: stopped(first.pid), 5, "B's first member stopped")
        try:
            rig.start("b-next", FREEZE="")
            wait_for(lambda: group_lag(settings, gb, [topic]) == 0
                     and processed_rows(url, SCHEMA) == (N, len(hostile)), 60,
                     "B's second member to take over and finish while the first is paused",
                     rig.all_logs, every_s=0.5)
            assert stopped(first.pid), "resumed early: inconclusive"
        finally:
            os.kill(first.pid, signal.SIGCONT)
        # The resumed member works through its stale batch (every bad position left in it
        # was marked by its successor meanwhile), then cannot store its offsets.
        wait_for(lambda: STALE_DONE in rig.log("b-paused"), 30,
                 "the resumed member to work through its stale batch", rig.all_logs,
                 every_s=0.2)
        wait_for(lambda: group_lag(settings, ga, [topic]) == 0
                 and group_lag(settings, gb, [topic]) == 0, 60, "both groups at lag 0",
                 lambda: rig.all_logs() + procs.logs(), every_s=0.5)
        time.sleep(2)  # whatever the resumed member still had fetched is worked through
        assert first.poll() is None and all(p.poll() is None for p in rig.procs), \
            rig.all_logs()
        paused_log = rig.log("b-paused")
    finally:
        rig.close()
    per: dict[str, collections.Counter[Position]] = collections.defaultdict(collections.Counter)
    for m in read_topic(settings, topic + ".dlq"):
        h = dict(m.headers() or [])
        per[h["dlq_consumer_group"].decode()][
            int(h["dlq_original_partition"] or b"-1"), int(h["dlq_original_offset"] or b"-1")] += 1
    assert processed_rows(url, SCHEMA) == (N, len(hostile)), "B: one effect row per event, " \
        "one marker per bad position"
    assert processed_rows(url)[1] == len(hostile), "A: one marker per bad position"
    return per, hostile, ga, gb, paused_log


def _assert_each_group_once(per: dict[str, collections.Counter[Position]],
                            hostile: set[Position], ga: str, gb: str) -> None:
    """Each group dead-lettered exactly ``hostile``, each position once, under its own name."""
    assert set(per) == {ga, gb}, f"DLQ records under groups {set(per)}, expected {ga}, {gb}"
    for g, c in per.items():
        assert set(c) == hostile, (g, sorted(set(c) ^ hostile))
        twice = {pos: n for pos, n in c.items() if n > 1}
        assert not twice, f"group {g} dead-lettered positions more than once: {twice}"


def _assert_not_again(paused_log: str, gb: str) -> None:
    """The resumed member logged that it met bad positions of its stale batch already
    dead-lettered by group ``gb`` (~10 per batch of 100: at least two)."""
    not_again = [ln for ln in paused_log.splitlines() if NOT_AGAIN in ln]
    assert all(ln.endswith("not again") and f"group {gb} " in ln for ln in not_again), not_again
    assert len(not_again) >= 2, paused_log[-3000:]


def test_two_groups_each_dead_letter_each_bad_position_once(
        settings: Settings, procs: ProcessRunner, tmp_path: Path) -> None:
    """B's first member paused inside its first batch's apply transaction (the next owner
    waits on its dedup rows until ``transaction_idle_timeout_s``, 3 s, ends its session)."""
    per, hostile, ga, gb, paused_log = _two_groups(settings, procs, tmp_path, "apply")
    _assert_each_group_once(per, hostile, ga, gb)
    _assert_not_again(paused_log, gb)

    def dry_run(*group: str) -> collections.Counter[Position]:
        out = procs.run("dlq", "replay", "--topic", "job.ready", "--dry-run", "--json",
                        *(("--group", group[0]) if group else ()))
        assert out.returncode == 0, out.stderr[-2000:]
        return collections.Counter((it["original_partition"], it["original_offset"])
                                   for it in json.loads(out.stdout)["replayed"])
    with ThreadPoolExecutor(3) as pool:  # three CLI start-ups at once
        by_a, by_b, both = pool.map(lambda g: dry_run(*g), [(ga,), (gb,), ()])
    assert by_a == per[ga], (by_a - per[ga], per[ga] - by_a)
    assert by_b == per[gb], (by_b - per[gb], per[gb] - by_b)
    assert both == per[ga] + per[gb], "the dry run without --group lists every group's record"


def test_a_member_paused_between_two_dead_letters_sends_none_twice(
        settings: Settings, procs: ProcessRunner, tmp_path: Path) -> None:
    """B's first member paused right after its first dead letter was durable, the rest of its
    batch's bad positions still to send (no transaction open: the pause is far shorter than
    the dead letter's idle limit, and no session is ended). Resumed, it finds each of them
    marked by its successor, logs so and sends none."""
    per, hostile, ga, gb, paused_log = _two_groups(settings, procs, tmp_path, "between")
    _assert_each_group_once(per, hostile, ga, gb)
    _assert_not_again(paused_log, gb)
