"""The "cpu" backend: paged attention in C++ with OpenMP, compiled at first use (docs/cpu.md)."""
