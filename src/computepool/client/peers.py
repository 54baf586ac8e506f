"""`PoolClient`'s discovery calls: the peers nodes reported, the discovery key, a node's report."""

from __future__ import annotations

from collections.abc import Mapping
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

    def list_peers(self) -> list[JSON]:
        return self._items("/peers")
