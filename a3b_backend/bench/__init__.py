"""Benchmark and load tooling (perf_analyzer inputs, reports, a load generator,
a server on free ports): used by perf/ and the tests, never by the served models."""
