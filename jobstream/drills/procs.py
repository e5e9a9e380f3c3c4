"""The one child-process runner of the harness: ``python -m jobstream.cli <args>`` children
with their settings in the environment and their output in a log file each, stopped with
SIGTERM then SIGKILL.

Tests (``tests/helpers.py``), the crash matrix (:mod:`jobstream.drills.chaos`), the demo
(:mod:`jobstream.drills.demo`) and the benchmarks (``bench/common.py``) all start their processes
here: one place decides how a child gets its settings (``JOBSTREAM_*`` variables, never the
parent's stray ones), where its output goes and how it is reaped.

Example
-------
>>> from pathlib import Path
>>> runner = ProcessRunner(child_env(), Path("/tmp/logs"))  # doctest: +SKIP
>>> relay = runner.start("relay")                            # doctest: +SKIP
>>> runner.stop_all()                                        # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from jobstream.settings import Settings

#: Variables a child must not inherit from the parent: its settings come from
#: :func:`child_env` only.
_STRAY = ("DATABASE_URL", "KAFKA_BOOTSTRAP_SERVERS")


def child_env(settings: Settings | None = None, *, keep_jobstream: bool = False,
              **extra: str) -> dict[str, str]:
    """The environment of a child process.

    Parameters
    ----------
    settings
        Carried whole (every field as ``JOBSTREAM_<FIELD>``, secrets revealed for the child:
        :meth:`Settings.to_env`). ``None``: only what the parent's environment has.
    keep_jobstream
        Keep the parent's ``JOBSTREAM_*``, ``DATABASE_URL`` and ``KAFKA_BOOTSTRAP_SERVERS``
        (the demo passes a user's own settings on); by default they are dropped, so the child
        gets exactly ``settings``.
    extra
        Variables added last (they win), e.g. ``JOBSTREAM_FAULT``.
    """
    env = {k: v for k, v in os.environ.items()
           if keep_jobstream or not (k.startswith("JOBSTREAM_") or k in _STRAY)}
    if settings is not None:
        env.update(settings.to_env())
    env.update(extra)
    return env


#: ``PR_SET_PDEATHSIG`` of ``<linux/prctl.h>`` (prctl(2)).
PR_SET_PDEATHSIG: Final = 1


def _load_prctl() -> Callable[..., int] | None:
    """libc's ``prctl`` (looked up once, in the parent: a child between fork and exec must not
    load a library), or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_int
    return fn


_PRCTL = _load_prctl()


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` for :class:`subprocess.Popen` that makes the child die (SIGKILL) when
    this process dies, however it dies (``kill -9`` of pytest or of a drill included), instead
    of leaking relays and workers that go on consuming the shared broker and Postgres. None
    where ``prctl(2)`` is not available (not Linux): the child then outlives a killed parent,
    as before.

    Linux ``PR_SET_PDEATHSIG`` (prctl(2)): the signal comes when the *thread* that forked the
    child ends, not only the process; the harness starts children from the main thread or
    from pool threads that live as long as their children (``run_points_concurrently``), never
    from a thread that ends first. SIGKILL, not SIGTERM: a SIGSTOPped child must die too. A
    parent that died before the child armed it is caught by comparing ``getppid()`` (the
    child then kills itself). The child's own children (a text-extraction subprocess) are
    not covered; they end with their bounded timeout.

    Raises ``OSError`` (from Popen, "Exception occurred in preexec_fn") if prctl fails."""
    prctl = _PRCTL
    if prctl is None:
        return None
    parent = os.getpid()

    def arm() -> None:  # runs in the child between fork and exec: nothing is loaded here
        if prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:  # the parent died before the line above
            os.kill(os.getpid(), signal.SIGKILL)

    return arm


def spawn(args: Sequence[str], env: Mapping[str, str], log: Path, *,
          cwd: Path | None = None) -> subprocess.Popen[bytes]:
    """Start ``python -m jobstream.cli <args>`` (this interpreter, so this checkout's code
    when run from its root) in its own session (a signal to the parent's group does not
    reach it), stdout and stderr written to ``log`` (truncated first). It dies with this
    process (:func:`die_with_parent`): a killed pytest or drill leaks no relay or worker."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as fh:  # the child keeps its own descriptor
        return subprocess.Popen([sys.executable, "-m", "jobstream.cli", *args], env=dict(env),
                                cwd=cwd, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=die_with_parent())


def stop(popens: Iterable[subprocess.Popen[bytes]], timeout_s: float = 20.0) -> None:
    """SIGTERM every process still running, then SIGKILL (and reap) what is left after
    ``timeout_s`` seconds in total."""
    popens = list(popens)
    for p in popens:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in popens:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


@dataclass
class Proc:
    """One started child process and its log file."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def log_text(self) -> str:
        """Everything the process wrote so far (undecodable bytes replaced)."""
        return self.log.read_text(errors="replace") if self.log.exists() else ""


class ProcessRunner:
    """Starts ``jobstream`` subcommands as children with one base environment, and stops
    them all at the end.

    Parameters
    ----------
    env
        The children's environment (:func:`child_env`); ``start(..., **env)`` adds to it.
    logdir
        Where each child's log goes: ``<name>-<n>.log`` (``n`` counts this runner's starts).
    cwd
        The children's working directory (default: the parent's).
    """

    def __init__(self, env: Mapping[str, str], logdir: Path, *, cwd: Path | None = None) -> None:
        self.base_env = dict(env)
        self.logdir = logdir
        self.cwd = cwd
        logdir.mkdir(parents=True, exist_ok=True)
        self.procs: list[Proc] = []

    def env(self, **extra: str) -> dict[str, str]:
        """The base environment plus ``extra``."""
        return {**self.base_env, **extra}

    def start(self, *args: str, name: str | None = None, **env: str) -> Proc:
        """Start ``jobstream <args>``; ``env`` adds variables (e.g. ``JOBSTREAM_FAULT``).
        ``name`` (default: the first of ``args``) names its log."""
        name = name or args[0]
        log = self.logdir / f"{name}-{len(self.procs)}.log"
        proc = Proc(name, spawn(args, self.env(**env), log, cwd=self.cwd), log)
        self.procs.append(proc)
        return proc

    def run(self, *args: str, timeout_s: float = 120.0,
            **env: str) -> subprocess.CompletedProcess[str]:
        """Run a one-off ``jobstream <args>`` to completion; stdout and stderr captured apart
        (so ``--json`` output can be parsed). Raises ``subprocess.TimeoutExpired`` after
        ``timeout_s`` seconds."""
        return subprocess.run([sys.executable, "-m", "jobstream.cli", *args],
                              env=self.env(**env), cwd=self.cwd, capture_output=True,
                              text=True, timeout=timeout_s)

    def kill9(self, proc: Proc) -> None:
        """SIGKILL a process (like ``kill -9``) and reap it (10 s at most)."""
        proc.popen.send_signal(signal.SIGKILL)
        proc.popen.wait(10)

    def dead(self, *, besides: Proc | None = None) -> list[Proc]:
        """The processes that exited (other than ``besides``)."""
        return [p for p in self.procs if p is not besides and p.popen.poll() is not None]

    def stop_all(self, timeout_s: float = 15.0) -> None:
        """SIGTERM everything still running, SIGKILL what is left after ``timeout_s``."""
        stop([p.popen for p in self.procs], timeout_s)

    def kill_all(self) -> None:
        """SIGKILL every child still running, its whole process group (each child has its own
        session, so a text-extraction subprocess goes too; a SIGSTOPped child dies as well),
        and reap it (10 s at most each). For the end of a test or drill point, once what it
        checks was read: :meth:`stop_all`'s graceful SIGTERM takes 1-3 s per stage worker and
        its whole timeout for a worker resumed after SIGSTOP (which does not exit on
        SIGTERM)."""
        for p in self.procs:
            if p.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.popen.pid, signal.SIGKILL)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(10)

    def logs(self, tail_chars: int = 3000) -> str:
        """The last ``tail_chars`` characters of every process log (for failure messages)."""
        return "\n".join(f"--- {p.name} (rc={p.popen.poll()})\n{p.log_text()[-tail_chars:]}"
                         for p in self.procs)
