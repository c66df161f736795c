"""A process that must not reach the network or serve anything: a connection to a host other than this one, a
name lookup other than localhost's, or a listening inet socket raises (an experiment tracker's upload, its
update check, a dashboard it would start)."""

import ipaddress
import socket
from collections.abc import Callable
from typing import Any


def _local(host: Any) -> bool:
    if host in ("localhost", "", None):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def block_network(set_attribute: Callable[[Any, str, Any], None] = setattr) -> None:
    """Guard this process's sockets (set_attribute: pytest's monkeypatch.setattr to undo it after a test)."""
    connect, getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def guarded_connect(self: socket.socket, address: Any) -> Any:
        if self.family in (socket.AF_INET, socket.AF_INET6) and not _local(address[0]):
            raise AssertionError(f"offline: a connection to {address}")
        return connect(self, address)

    def guarded_getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if not _local(host):
            raise AssertionError(f"offline: a name lookup of {host!r}")
        return getaddrinfo(host, *args, **kwargs)

    def refused_listen(self: socket.socket, *args: Any) -> None:
        raise AssertionError(f"offline: a listening socket ({self.family!r})")

    set_attribute(socket.socket, "connect", guarded_connect)
    set_attribute(socket, "getaddrinfo", guarded_getaddrinfo)
    set_attribute(socket.socket, "listen", refused_listen)
