"""`PoolClient`'s image calls: publish an image (pinned to its id), list them, unpublish one."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    JSON = dict[str, Any]


class ImageMethods:
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

    def publish_image(self, name: str, digest: str, tenants: Sequence[str] | None = None) -> JSON:
        """Pin `name` to the image id `digest` for `tenants` (None: every tenant); admins only."""
        body = {"name": name, "digest": digest, "tenants": list(tenants) if tenants is not None else None}
        return dict(self.request("POST", "/images", json=body))

    def list_images(self) -> list[JSON]:
        return self._items("/images")

    def unpublish_image(self, name: str) -> JSON:
        return dict(self.request("DELETE", "/images", params={"name": name}))


def local_image_id(name: str) -> str | None:
    """The id (sha256:…) this machine's podman has for the image `name`; None without podman or image."""
    podman = shutil.which("podman")
    if podman is None:
        return None
    done = subprocess.run(
        [podman, "image", "inspect", "--format", "{{.Id}}", name],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    return "sha256:" + done.stdout.strip().removeprefix("sha256:") if done.returncode == 0 else None
