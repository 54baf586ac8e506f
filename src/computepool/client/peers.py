"""`PoolClient`'s discovery calls: the peers nodes reported, the discovery key, a node's report."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    JSON = dict[str, Any]


class PeerMethods:
    """Mixed into PoolClient, which provides `request` and `_items`."""

    if TYPE_CHECKING:

        def request(
            self,
            method: str,
            path: str,
            *,
            json: object = None,
            params: Mapping[str, Any] | None = None,
            headers: Mapping[str, str] | None = None,
            api: bool = True,
        ) -> Any: ...  # PoolClient's

        def _items(self, path: str, params: Mapping[str, Any] | None = None) -> list[JSON]: ...

    def list_peers(self, observer: str | None = None) -> list[JSON]:
        """One row per observer × peer, as each node last reported (`merge_peers` groups them)."""
        return self._items("/peers", {"observer": observer} if observer else None)

    def discovery_key(self) -> JSON:
        """The pool's discovery key and fingerprint (a node credential only)."""
        return dict(self.request("GET", "/discovery/key"))

    def report_peers(self, node: str, peers: Sequence[Mapping[str, Any]]) -> list[JSON]:
        """Replace what `node` reports (its own node credential only)."""
        return list(self.request("PUT", f"/nodes/{node}/peers", json={"peers": list(peers)})["items"])


def merge_peers(rows: Sequence[Mapping[str, Any]]) -> list[JSON]:
    """Group the per-observer rows by peer: one item per peer with who saw it (`seen_by`, with each
    link's figures) and `rejected`: None, or the reason any observer gave for refusing it (one
    node's doubt, such as a copied identity, is worth showing even when others trust the peer)."""
    merged: dict[str, JSON] = {}
    for r in rows:
        item = merged.get(r["peer_key"])
        if item is None:
            item = merged[r["peer_key"]] = {
                "peer": r["peer_key"],
                "node_id": r.get("node_id"),
                "address": r.get("address", ""),
                "port": r.get("port"),
                "devices": list(r.get("devices") or []),
                "seen_by": [],
                "rejected": None,
            }
        if r["status"] == "ok":
            if not item["devices"]:
                item["devices"] = list(r.get("devices") or [])
            item["node_id"] = item["node_id"] or r.get("node_id")
        elif item["rejected"] is None:
            item["rejected"] = r.get("reason") or "rejected"
        item["seen_by"].append(
            {
                "observer": r["observer"],
                "status": r["status"],
                "reason": r.get("reason", ""),
                "source": r.get("source", ""),
                "rtt_ms": r.get("rtt_ms"),
                "bandwidth_mbps": r.get("bandwidth_mbps"),
                "last_seen": r.get("last_seen"),
            }
        )
    return sorted(merged.values(), key=lambda i: (i["rejected"] is not None, i["peer"]))
