"""Typed errors shared by the library, the client and the services.

Errors carry data (the field, the reason, the delay) so that callers can act on them
instead of parsing messages.
"""

from __future__ import annotations


class TrainguardError(Exception):
    """Base class of every error trainguard raises on purpose."""


class InvalidToken(TrainguardError, ValueError):
    """A job, host or rank that cannot be one token of a NATS subject."""

    def __init__(self, what: str, value: object, why: str) -> None:
        self.what = what
        self.value = value
        self.why = why
        super().__init__(f"invalid {what} {value!r}: {why}")


class DecodeError(TrainguardError, ValueError):
    """A message that does not decode into the schema it claims.

    ``reason`` is the human-readable cause (it names the offending field where the
    decoder knows it); it travels with the message into the dead-letter subject.
    """

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


class MessageTooLarge(DecodeError):
    """A message over a size limit, refused whole: at publish (it would exceed the server's
    ``max_payload`` or the durable limit) and at decode (before its body is read).

    ``size`` and ``limit`` are in bytes; ``what`` names the message (its kind or subject).
    A :class:`DecodeError`, so a receiver dead-letters it like any unreadable message.
    """

    def __init__(self, what: str, size: int, limit: int) -> None:
        self.what = what
        self.size = size
        self.limit = limit
        super().__init__(f"oversized {what}: {size} bytes exceeds the {limit}-byte limit")


class ConfigError(TrainguardError, ValueError):
    """A setting from the environment, a CLI flag or a file that cannot be used."""


class ServerStartError(TrainguardError, RuntimeError):
    """An embedded nats-server or redis-server that did not come up."""


class NotStarted(TrainguardError, RuntimeError):
    """A service's runtime (bus, Redis, timers) used before :func:`run_service` started it.

    ``what`` names the service, so a handler wired too early says whose it is.
    """

    def __init__(self, what: str) -> None:
        self.what = what
        super().__init__(f"{what} used before start")


class Retry(TrainguardError):
    """Raised by a handler: settle the message with a delayed redelivery.

    Use it for transient trouble (a dependency briefly down) that a later delivery
    will get past; it never sends the message to the dead-letter subject.
    """

    def __init__(self, delay: float = 1.0, reason: str = "retry requested") -> None:
        self.delay = delay
        self.reason = reason
        super().__init__(f"{reason} (retry in {delay:.1f}s)")


class Reject(TrainguardError):
    """Raised by a handler: the message can never be processed; dead-letter it now."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


class DrillCrash(TrainguardError, RuntimeError):
    """Raised into the training loop by the ``crash`` drill: the one exception the client
    lets through on purpose."""


class SkipStep(TrainguardError):
    """Raised inside ``with guard.step(n)`` to end step ``n`` without an update.

    The step's context manager absorbs it: the step counts as done (``guard.steps`` goes
    on to the next one, commands run at its end) with no loss, no gradient and no
    optimizer step. Every rank must skip the same step (``trainguard.torch.BatchCheck``
    agrees on it before raising), or the ranks' collectives no longer match.
    """


class Misaddressed(DecodeError):
    """A message whose body names another job, rank or host than the subject it came on.

    The subject is what the server's permissions bind a sender to; a body that disagrees
    speaks in someone else's name, so a receiver dead-letters it like an unreadable one.
    """
