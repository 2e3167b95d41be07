"""Benchmarks and load generators: scripts a user runs, which print tables."""
