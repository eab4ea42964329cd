"""Host and port as written in URLs and `host:port` addresses."""

from __future__ import annotations


def host_port(host: str, port: int | str) -> str:
    """`host:port`, with an IPv6 literal in brackets (`[::1]:8000`), as RFC 3986
    §3.2.2 requires for URLs and gRPC, torch `tcp://` and most clients accept.

    `host` is a name, an IPv4 address or an IPv6 address (a zone such as `fe80::1%eth0`
    is kept; an already bracketed one is left alone). Raises nothing.
    """
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def http_url(host: str, port: int | str, scheme: str = "http") -> str:
    """`scheme://host:port` (no trailing slash) with IPv6 literals bracketed:
    `http_url("::1", 8000) == "http://[::1]:8000"`. Raises nothing."""
    return f"{scheme}://{host_port(host, port)}"
