"""Benchmarks of cula against FLA (tools/bench/<name>.py), built on tools/bench/harness.py."""
