"""Fault-injection points for crash tests: the process SIGKILLs itself at a named point.

Armed by ``JOBSTREAM_FAULT=<point>[,<point>…]`` (optionally ``<point>@N`` to fire on the N-th
hit); with the variable unset every call is a no-op. SIGKILL, not an exception: nothing gets a
chance to clean up, exactly like ``kill -9`` or an OOM kill. ``<point>[@N]=stop`` sends SIGSTOP
instead: the process freezes there (a long GC pause, a stalled VM) until someone sends SIGCONT,
which is how tests let a lease expire under a run that is still alive.

Points: ``llm_chunk_answered_before_save`` (a chunk's answer arrived, its output is not saved
yet), ``llm_after_provider_before_checkpoint`` (every chunk answered and saved, the ``llm``
checkpoint not written yet), ``stage_inside_one_transaction`` (a one-transaction stage's work
done, its completion not written, the job row locked), ``stage_inside_claim_transaction`` (a
two-transaction stage's claim made, its transaction not committed, the job row locked),
``stage_after_commit_before_offset``,
``intake_batch_before_commit`` (an intake batch's intents written, its transaction not committed),
``relay_after_produce_before_mark`` (also ``relay_after_produce_before_mark:<event_type>``, hit
once per event type in the batch), ``consumer_after_apply_before_offset``,
``consumer_inside_transaction`` (the idempotent consumer's handler ran, its transaction, with
the batch's ``processed_event`` rows, not committed yet).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections import Counter

POINTS = (
    "llm_chunk_answered_before_save",
    "llm_after_provider_before_checkpoint",
    "stage_inside_one_transaction",
    "stage_inside_claim_transaction",
    "stage_after_commit_before_offset",
    "intake_batch_before_commit",
    "relay_after_produce_before_mark",
    "consumer_after_apply_before_offset",
    "consumer_inside_transaction",
)
_hits: Counter[str] = Counter()


def armed() -> bool:
    """True when some fault point is armed (``JOBSTREAM_FAULT`` set): a caller can skip work
    that only names points (e.g. the relay's per-event-type points of a batch)."""
    return bool(os.environ.get("JOBSTREAM_FAULT"))


def point(name: str) -> None:
    """SIGKILL (or SIGSTOP) this process if ``name`` is armed and this is its N-th hit; else
    return. Raises ``ValueError`` for an action other than ``kill`` or ``stop``."""
    spec = os.environ.get("JOBSTREAM_FAULT")
    if not spec:
        return
    _hits[name] += 1
    for item in spec.split(","):
        armed, _, action = item.strip().partition("=")
        armed, _, nth = armed.partition("@")
        if armed == name and _hits[name] == int(nth or 1):
            if action not in ("", "kill", "stop"):
                raise ValueError(f"JOBSTREAM_FAULT action {action!r}: use kill or stop")
            sig = signal.SIGSTOP if action == "stop" else signal.SIGKILL
            print(f"[fault] {name}: {sig.name} pid {os.getpid()}", file=sys.stderr, flush=True)
            # To this thread (tgkill), not the process: a process-directed SIGSTOP is taken by
            # one thread (often the main one), and the caller, not yet woken to stop, ran on
            # for as long as that thread waited for a CPU: on a loaded machine long enough to
            # send its transaction's COMMIT (robust11: "stopped inside the claim transaction"
            # froze after it). A thread-directed stop signal still stops the whole process.
            signal.pthread_kill(threading.get_ident(), sig)
