"""Benchmarks: they report numbers and never assert them. Run with ``kvrouterd bench``."""
