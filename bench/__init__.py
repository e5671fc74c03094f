"""Benchmarks: each prints JSON lines and measures its baseline in the same run."""
