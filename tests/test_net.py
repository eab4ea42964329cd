"""host:port and URLs with IPv6 literals in brackets (flowengine/net.py)."""

from __future__ import annotations

import pytest

from flowengine.net import host_port, http_url


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("127.0.0.1", "127.0.0.1:8000"),
        ("localhost", "localhost:8000"),
        ("::1", "[::1]:8000"),
        ("::", "[::]:8000"),
        ("fe80::1%eth0", "[fe80::1%eth0]:8000"),
        ("[::1]", "[::1]:8000"),  # already bracketed: left alone
    ],
)
def test_host_port_brackets_ipv6_literals_only(host, expected):
    assert host_port(host, 8000) == expected
    assert http_url(host, 8000) == f"http://{expected}"
    assert http_url(host, 8443, "https") == f"https://{expected.replace('8000', '8443')}"


def test_bench_serve_default_base_url_is_a_valid_ipv6_url():
    """`flowengine bench serve --host ::1` built http://::1:8000, which httpx cannot
    parse as host ::1 port 8000."""
    import httpx

    url = httpx.URL(http_url("::1", 8000))
    assert (url.host, url.port) == ("::1", 8000)
