"""Which host names the dashboard answers to: its defence against DNS rebinding.

A page on ``attacker.example`` can make that name resolve to 127.0.0.1 a moment after
it loaded; the browser then sends the page's requests to the dashboard, as the same
origin as the page, with ``Host: attacker.example``. The dashboard answers only to a
``Host`` it was told about, so such a request is refused before it reads or acts:

- the address it is bound to, with the bound port;
- when bound to loopback, also ``localhost``, ``127.0.0.1`` and ``[::1]`` on that port
  (no other site can name them);
- when bound to every interface (``0.0.0.0``, ``::``), the address the connection came
  in on (an IP address: a rebinding attack needs a name), on the bound port;
- each ``--allowed-host`` (``NAME`` on any port, or ``NAME:PORT``), for a dashboard
  behind a reverse proxy that passes the public name on.

The same rules judge an action's ``Origin``: "our own origin" comes from this
configuration, never from a header of the request.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

__all__ = ["HostPolicy", "format_host", "parse_authority", "root_url"]

#: Names of the loopback interface; no other site can be reached under them.
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
#: The port a ``Host`` or an ``Origin`` without one means, by scheme.
DEFAULT_PORTS = {"http": 80, "https": 443}


def _normal(host: str) -> str:
    """``host`` lowercased, an IP address in its canonical spelling."""
    host = host.lower()
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host


def parse_authority(value: str) -> tuple[str, int | None] | None:
    """``(host, port)`` of ``name``, ``name:port``, ``[v6]`` or ``[v6]:port``; the host
    lowercased, without brackets; ``None`` when ``value`` is malformed (an IPv6 address
    without brackets, a port that is not a number from 0 to 65535, a space, ...)."""
    if not value or not value.isascii() or any(c in value for c in " \t/\\?#@"):
        return None
    if value.startswith("["):
        end = value.find("]")
        host, rest = value[1:end], value[end + 1 :]
        if end < 0 or not host or (rest and not rest.startswith(":")):
            return None
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return None
        port = rest[1:] if rest else None
    else:
        host, sep, port_text = value.partition(":")
        if not host or ":" in port_text:
            return None
        port = port_text if sep else None
    if port is None:
        return _normal(host), None
    if not port.isdigit() or len(port) > 5 or int(port) > 65535:
        return None
    return _normal(host), int(port)


def format_host(host: str) -> str:
    """``host`` as it is written in a URL: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host


def root_url(host: str, port: int) -> str:
    """The dashboard's address when it listens on ``host`` and ``port``."""
    return f"http://{format_host(host)}:{port}/"


def _is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return host == ""


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


@dataclass(frozen=True, slots=True)
class HostPolicy:
    """The hosts one dashboard answers to: its bind address and port, and the names
    an operator allowed (see the module's documentation)."""

    bind_host: str
    bind_port: int
    allowed: tuple[tuple[str, int | None], ...] = ()

    @classmethod
    def of(cls, bind: tuple[str, int], allowed_hosts: Iterable[str] = ()) -> HostPolicy:
        """The policy of a dashboard bound to ``bind`` that also answers to each of
        ``allowed_hosts`` (``NAME`` or ``NAME:PORT``); :class:`ValueError` names a
        malformed entry."""
        allowed = []
        for entry in allowed_hosts:
            parsed = parse_authority(entry.strip())
            if parsed is None or "*" in parsed[0]:
                raise ValueError(
                    f"{entry!r} is not a host name: expected NAME or NAME:PORT "
                    "(an IPv6 address in brackets; no wildcards)"
                )
            allowed.append(parsed)
        host, port = bind
        return cls(_normal(host.strip("[]")), port, tuple(allowed))

    def root(self) -> str:
        """The dashboard's address, for a message (the bound one)."""
        return root_url(self.bind_host, self.bind_port)

    def _bound(self, host: str, port: int, server: tuple[str, int | None] | None) -> bool:
        bound_port = self.bind_port or (server[1] if server else None)
        if port != bound_port:
            return False
        names = {self.bind_host}
        if _is_wildcard(self.bind_host):
            # The connection's own address: an IP address, which no other site can
            # make a browser treat as its origin.
            names = {_normal(server[0])} if server else set()
        if any(_is_loopback(n) for n in names):
            names |= LOOPBACK_NAMES
        return host in names and not _is_wildcard(host)

    def accepts(
        self,
        authority: str,
        server: tuple[str, int | None] | None,
        *,
        scheme: str = "http",
    ) -> bool:
        """Whether ``authority`` (a ``Host`` header, or an origin's host and port, as
        reached over ``scheme``) names this dashboard; ``server``: the address the
        connection came in on, as the ASGI server reports it."""
        parsed = parse_authority(authority)
        if parsed is None or scheme not in DEFAULT_PORTS:
            return False
        host, given = parsed
        port = DEFAULT_PORTS[scheme] if given is None else given
        for name, allowed_port in self.allowed:
            if host == name and allowed_port in (None, port):
                return True
        # The dashboard itself serves plain HTTP: an https origin can only be a proxy's.
        return scheme == "http" and self._bound(host, port, server)

    def accepts_origin(self, origin: str, server: tuple[str, int | None] | None) -> bool:
        """Whether ``origin`` (an ``Origin`` header) is this dashboard's own."""
        try:
            parts = urlsplit(origin)
        except ValueError:
            return False
        if parts.path or parts.query or parts.fragment or parts.username or parts.password:
            return False
        return self.accepts(parts.netloc, server, scheme=parts.scheme.lower())
