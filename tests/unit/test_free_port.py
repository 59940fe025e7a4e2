"""free_port never hands the same port out twice in one process."""

from __future__ import annotations

import socket

from trainguard.runtime.embedded import free_port


def test_ports_handed_out_in_a_row_are_all_different() -> None:
    # A Redis, a NATS and a rendezvous store picked together once got the same port (the
    # kernel may offer a just-closed one again): each must get its own.
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)


def test_a_handed_out_port_is_bindable() -> None:
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))
