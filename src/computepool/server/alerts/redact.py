"""Webhook URLs may carry secrets (a token in the path, `user:password@`): everything the pool
writes about one (audit records, a delivery's last error, log lines) names it by origin and id."""

from __future__ import annotations

from urllib.parse import urlsplit


def url_origin(url: str) -> str:
    """`scheme://host[:port]` of `url`, without credentials, path or query."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or "?"
        port = parts.port
    except ValueError:
        return "(unreadable URL)"
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    return f"{parts.scheme}://{host}" + (f":{port}" if port is not None else "")


def hook_name(hook_id: int | None, url: str | None) -> str:
    """How a webhook is named in errors and logs: its id and origin."""
    return f"webhook {hook_id} ({url_origin(url) if url else 'deleted'})"


def scrub(text: str, url: str | None) -> str:
    """`text` (an exception's message) with `url` shown as its origin, and its path, query and
    credentials, wherever they appear alone, left out."""
    if not url:
        return text
    origin = url_origin(url)
    try:
        parts = urlsplit(url)
        userinfo = parts.netloc.rpartition("@")[0]
        pieces = [parts.path, parts.query, parts.fragment, userinfo, parts.username, parts.password]
    except ValueError:
        pieces = []
    whole = sorted({url, url.split("#", 1)[0], url.split("?", 1)[0]}, key=len, reverse=True)
    for u in whole:
        text = text.replace(u, origin)
    for piece in sorted({p for p in pieces if p and len(p) > 1}, key=len, reverse=True):
        text = text.replace(piece, "…")
    return text
