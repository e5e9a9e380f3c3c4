"""The test and drill harness: what tests, the chaos matrix, the demo and the benchmarks use to
drive jobstream from outside (child processes), never imported by the runtime modules
(worker, relay, API, consumers)."""
