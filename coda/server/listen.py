"""The server's listening socket, bound before anything slow happens (issue 19 item 4).

``coda serve`` binds its address first: a port already in use is reported in a second, with
exit status 2, instead of after the whole model has loaded (and after uvicorn has logged
"Application startup complete"). The bound socket is then handed to uvicorn as it is, so no
other process can take the port in between.
"""

from __future__ import annotations

import socket


class ListenError(OSError):
    """The address cannot be listened on; the message names it and why."""


def bind_listener(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (not yet listening; uvicorn calls ``listen``).

    Raises :class:`ListenError` naming the address and the reason (in use, no permission,
    unknown host)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ListenError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    # NOTE: SO_REUSEADDR as uvicorn sets it: a port left in TIME_WAIT by a previous server is
    # reusable, a port another process listens on is not
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        why = "the port is already in use" if exc.errno == 98 else exc.strerror
        raise ListenError(f"cannot listen on {host}:{port}: {why}") from None
    sock.set_inheritable(True)
    return sock
