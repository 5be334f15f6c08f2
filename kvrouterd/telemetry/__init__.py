"""Traces and metrics, applied to the core's decisions from the outside."""

from .metrics import Metrics, build_meter_provider
from .tracing import annotate_batch, annotate_decision, build_tracer_provider

__all__ = ["Metrics", "annotate_batch", "annotate_decision", "build_meter_provider", "build_tracer_provider"]
