"""A ``.creds`` file as nats-py's ``user_credentials``: its own module, so that reading a
process's settings (:mod:`.auth`) loads no NATS client (a disabled Guard loads none)."""

from __future__ import annotations

from pathlib import Path

from nats.aio.client import RawCredentials


class CredsFile(RawCredentials):
    """A ``.creds`` file for nats-py's ``user_credentials``, read whole at every connect
    and reconnect, so a renewed file is used from the next reconnect on. (Given a path,
    nats-py reads the seed unbuffered, one system call per byte: about 1 ms a connect.)"""

    def __init__(self, path: str) -> None:  # no UserString state: ``data`` is the file
        self.path = path

    @property
    def data(self) -> str:
        return Path(self.path).read_text()

    @data.setter
    def data(self, value: str) -> None:
        raise AttributeError("a creds file is read from its path")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CredsFile) and other.path == self.path

    __hash__ = None  # type: ignore[assignment]
