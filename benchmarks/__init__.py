"""Benchmarks of shmtensor beside its peers; run them with ``scripts/bench``."""
