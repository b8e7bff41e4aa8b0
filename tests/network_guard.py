"""Keeps the tests on loopback: a connection from the test process to any other
address is refused and recorded, and the test that made it fails.

Tests and harnesses reach the network only through the package clients as the
machine configures them (pip, apt, npm), which run as processes of their own;
an address built by hand (a registry's JSON API, a file host) may be
unreachable on a machine whose index is a mirror, and hides behind warm caches
until a fresh machine meets it. The guard wraps `socket.socket.connect` and
`connect_ex`, which every client in this process goes through (urllib,
requests, http.client, asyncio's sockets).
"""

from __future__ import annotations

import ipaddress
import socket
import traceback

_LOCAL_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost"}
violations: list[str] = []
_original_connect = socket.socket.connect
_original_connect_ex = socket.socket.connect_ex


class NonLoopbackConnection(RuntimeError):
    """Not an OSError: code that treats OSError as 'engine down' must not swallow it."""


def is_local(address: object) -> bool:
    """True for a loopback or unspecified address (0.0.0.0 reaches this host) or a name for it."""
    if not isinstance(address, tuple) or not address:
        return True  # AF_UNIX paths and other local families
    host = address[0]
    if isinstance(host, bytes):
        host = host.decode("ascii", "replace")
    host = str(host).split("%", 1)[0]
    if host.lower() in _LOCAL_NAMES:
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False  # a name: the guard does not resolve it, so it refuses it
    return ip.is_loopback or ip.is_unspecified


def _check(sock: socket.socket, address: object) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6) and not is_local(address):
        where = "".join(traceback.format_stack(limit=8)[:-2])
        violations.append(f"connect to {address!r} from:\n{where}")
        raise NonLoopbackConnection(
            f"the tests reach only 127.0.0.1; a connection to {address!r} was refused "
            "(download through pip, apt or npm instead)")


def _guarded_connect(self, address):
    _check(self, address)
    return _original_connect(self, address)


def _guarded_connect_ex(self, address):
    _check(self, address)
    return _original_connect_ex(self, address)


def install() -> None:
    socket.socket.connect = _guarded_connect
    socket.socket.connect_ex = _guarded_connect_ex


def take_violations() -> list[str]:
    taken = list(violations)
    violations.clear()
    return taken
