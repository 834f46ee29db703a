"""Observability shared by every process: traces, logs, the flight recorder (see docs/observability.md)."""
