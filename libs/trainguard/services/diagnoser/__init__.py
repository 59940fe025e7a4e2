"""The diagnoser: from anomalies, worker exits and GPU telemetry to one root cause, with
evidence, a confidence and the recommended actions (docs/design.md, section 6)."""
