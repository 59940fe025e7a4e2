"""The remediator: diagnoses in, actions out, one incident per root cause, one leader.

``engine``, ``intake``, ``conduct``, ``endings`` and ``recovery`` hold every decision
(pure, table-tested); ``service`` is the async shell that carries them out, with ``store``
(Redis), ``acks``, ``coordinator`` (checkpoint RPCs), ``hooks`` and ``leader`` beside it.
"""
