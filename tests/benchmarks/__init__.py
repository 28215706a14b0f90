"""Tests of the benchmark code in benchmarks/ (its simulators, traces and pure parts; the GPU benchmark on CPU)."""
