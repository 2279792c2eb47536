"""Benchmarks for tdmesh; run them from the repository root (see bench/README.md)."""
