"""The test and drill harness: what tests, the crash matrix, the demo and the benchmarks use to
drive jobstream from outside. Never imported by the runtime modules (worker, relay, API,
consumers); the CLI imports it lazily, only for its harness commands (``jobstream chaos``,
``jobstream demo``, ``jobstream fake-provider``).

- :mod:`jobstream.drills.procs`: the one child-process runner (``python -m jobstream.cli``
  children, their environment and logs, SIGTERM then SIGKILL);
- :mod:`jobstream.drills.fake_provider`: a scriptable OpenAI-compatible provider on loopback;
- :mod:`jobstream.drills.chaos`: the crash matrix (kill) and the pause matrix;
- :mod:`jobstream.drills.demo`: ``jobstream demo``, the whole pipeline on real documents.
"""
