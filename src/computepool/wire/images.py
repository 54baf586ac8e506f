"""Published container images: a registry name pinned to one image digest, for all or named tenants."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import Field, StringConstraints

from computepool.wire.allocations import ImageRef
from computepool.wire.common import In, Name, Out

MAX_IMAGE_TENANTS = 256
Digest = Annotated[
    str,
    StringConstraints(pattern=r"^sha256:[a-f0-9]{64}$"),
    Field(description="The image's id (the digest of its config, as `podman image inspect` shows it)."),
]


class ImagePublish(In):
    name: ImageRef
    digest: Digest
    tenants: list[Name] | None = Field(
        default=None,
        max_length=MAX_IMAGE_TENANTS,
        description="The tenants that may run it; omitted: every tenant.",
    )


class ImageOut(Out):
    name: str
    digest: str
    tenants: list[str] | None = Field(description="The tenants that may run it; null: every tenant.")
    published_by: str
    created_at: datetime
