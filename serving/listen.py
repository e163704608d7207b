"""Listen addresses: parse ``host:port`` / ``:port`` / ``[v6addr]:port`` and open the listening socket."""

from __future__ import annotations

import socket


class ListenAddressError(ValueError):
    pass


def parse_listen_address(addr: str) -> tuple[str, int]:
    """``host:port``, ``:port`` (all interfaces) or ``[v6addr]:port`` -> (host, port).

    A host name is resolved here, so one that does not resolve is a ListenAddressError too.
    """
    host, sep, port_s = addr.rpartition(":")
    if not sep:
        raise ListenAddressError(f"invalid listen address {addr!r}: expected host:port, e.g. :9445 or 127.0.0.1:9445")
    if host.startswith("["):
        if not host.endswith("]"):
            raise ListenAddressError(f"invalid listen address {addr!r}: unbalanced [")
        host = host[1:-1]
    elif ":" in host:
        raise ListenAddressError(f"invalid listen address {addr!r}: write IPv6 addresses as [addr]:port")
    try:
        port = int(port_s)
    except ValueError:
        raise ListenAddressError(f"invalid listen address {addr!r}: port {port_s!r} is not a number") from None
    if not 0 <= port <= 65535:
        raise ListenAddressError(f"invalid listen address {addr!r}: port out of range")
    if host:
        _resolve(addr, host, port)
    return host, port


def _resolve(addr: str, host: str, port: int) -> tuple[socket.AddressFamily, str]:
    """(address family, numeric address) of a listen host, or ListenAddressError."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ListenAddressError(f"invalid listen address {addr!r}: cannot resolve {host!r}: {e.strerror}") from None
    except UnicodeError:  # e.g. an empty or over-long label, refused by the IDNA codec
        raise ListenAddressError(f"invalid listen address {addr!r}: {host!r} is not a valid host name") from None
    return infos[0][0], str(infos[0][4][0])


def listening_socket(listen_address: str) -> socket.socket:
    """A non-blocking socket bound to ``listen_address`` and listening; ``:port`` listens on every IPv4
    and IPv6 address where the host has dual-stack sockets. ListenAddressError or OSError."""
    host, port = parse_listen_address(listen_address)
    dualstack = False
    if not host:
        if socket.has_dualstack_ipv6():
            family, host, dualstack = socket.AF_INET6, "::", True
        else:
            family, host = socket.AF_INET, "0.0.0.0"
    else:
        family, host = _resolve(listen_address, host, port)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if dualstack:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host, port))
        sock.listen(128)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock
