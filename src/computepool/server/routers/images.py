"""Published container images (what a tenant may run, pinned to a digest)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query

from computepool.server.context import Ctx
from computepool.server.deps import requires
from computepool.server.logic import images
from computepool.server.policy import Action
from computepool.wire.common import Items
from computepool.wire.images import ImageOut, ImagePublish

router = APIRouter(tags=["images"])


@router.post("/images", summary="Publish an image to all or named tenants, pinned to a digest (admin)")
def publish(body: ImagePublish, ctx: Annotated[Ctx, Depends(requires(Action.IMAGE_PUBLISH))]) -> ImageOut:
    return images.publish(ctx, body)


@router.get("/images", summary="Images the caller's tenant may run (every published image for admins)")
def list_images(ctx: Annotated[Ctx, Depends(requires(Action.IMAGE_LIST))]) -> Items[ImageOut]:
    return images.list_all(ctx)


@router.delete("/images", summary="Stop publishing an image (admin)")
def unpublish(
    name: Annotated[str, Query(max_length=255, description="The published name (it holds slashes).")],
    ctx: Annotated[Ctx, Depends(requires(Action.IMAGE_UNPUBLISH))],
) -> ImageOut:
    return images.unpublish(ctx, name)
