"""A node's network address as its peers dial it: an IP address or a DNS host name.

One rule for the agent's `--address` and the control plane's API, so an address the agent accepts is
one the server stores and a gang's members can put in `MASTER_ADDR`.
"""

from __future__ import annotations

import ipaddress
import re

from computepool.core.errors import InvalidInput

MAX_ADDRESS_LEN = 253  # the longest DNS name
_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


def check_address(text: str, field: str = "address") -> str:
    """`text` as a stored address (IPv6 without brackets, host names lower case); InvalidInput if it
    is neither an IP address nor a host name."""
    value = text.strip()
    if value.startswith("[") and value.endswith("]"):
        value = value[1:-1]
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        pass
    name = value.rstrip(".").lower()
    labels = name.split(".")
    if (
        not name
        or len(name) > MAX_ADDRESS_LEN
        or not all(_LABEL.match(label) for label in labels)
        or labels[-1].isdigit()  # 10.0.0.300 is a bad IP, not a host name
    ):
        raise InvalidInput(field, f"expected an IP address or a host name, got {text!r}")
    return name
