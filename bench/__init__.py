"""Benchmarks: each script prints one JSON object (see bench/README.md)."""
