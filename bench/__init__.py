"""Benchmarks: pytest-benchmark suites (bench/test_bench_*.py) and benchmark scripts."""
