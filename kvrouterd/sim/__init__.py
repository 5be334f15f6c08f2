"""Trace-driven simulation: the daemon's own Router and policies, with simulated edges."""
