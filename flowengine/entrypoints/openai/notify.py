"""systemd's notification protocol (`sd_notify`) with the socket module.

Protocol (man sd_notify(3), "Notes"): newline-separated `KEY=VALUE` assignments sent
as one datagram to the AF_UNIX SOCK_DGRAM socket named by `$NOTIFY_SOCKET`; a name
that starts with "@" is in the abstract namespace (the "@" stands for a NUL byte).
The server sends `READY=1` once the weights are loaded and the listening socket
accepts connections (`Type=notify` units start their dependants only then),
`STOPPING=1` when it starts draining, and `STATUS=...` lines that `systemctl status`
shows.
"""

from __future__ import annotations

import logging
import os
import socket

logger = logging.getLogger(__name__)


def notify_address(value: str) -> str | bytes:
    """The socket address for a `$NOTIFY_SOCKET` value.

    Raises ValueError for a value that is neither a path nor an abstract name.
    """
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    raise ValueError(
        f"NOTIFY_SOCKET={value!r} is neither an absolute path nor an abstract '@' name"
    )


def sd_notify(state: str, *, environ: dict[str, str] | None = None) -> bool:
    """Send `state` (e.g. "READY=1") to systemd; False when not run under systemd.

    Errors (socket gone, permission) are logged, not raised: a server must keep
    serving when the service manager went away.
    """
    value = (os.environ if environ is None else environ).get("NOTIFY_SOCKET")
    if not value:
        return False
    try:
        address = notify_address(value)
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.sendto(state.encode(), address)
    except (OSError, ValueError) as err:
        logger.warning("could not notify systemd (%s): %s", state.split("\n")[0], err)
        return False
    return True
