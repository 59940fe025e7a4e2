"""The remediator: diagnoses in, actions out, one incident per root cause, one leader.

``engine`` and ``endings`` hold every decision (pure, table-tested); ``service`` is the
async shell, with ``store`` (Redis), ``acks``, ``coordinator`` (checkpoint RPCs) and
``leader`` beside it.
"""
