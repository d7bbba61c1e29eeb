"""The sidecar's listening socket: TCP_NODELAY on every accepted connection.

Without it a response's header and body writes wait on the client's delayed ACK (about 40 ms per
HTTP call on Linux), which every weight sync pays four times."""

from __future__ import annotations

import socket

from sidecar.cli.launch import bind


def test_accepted_connections_have_nodelay() -> None:
    with bind("127.0.0.1", 0) as listener:
        assert listener.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        with socket.create_connection(listener.getsockname()[:2], timeout=5):
            conn, _ = listener.accept()
            with conn:
                assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
