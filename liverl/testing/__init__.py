"""Helpers shared by the tests and the benchmarks (tiny models built locally); never imported by a process."""
