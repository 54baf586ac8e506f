"""Which container images a tenant may run, and which image a name means: published and pinned.

A name on a node means whatever was last tagged with it there, so the pool never runs a name: at
admission a request's image is pinned to the digest an admin published for it (`image_digest` in
the stored request, in the allocation's audit record, and in the node's assignment), and the agent
runs that image id. Retagging the name on a node afterwards changes nothing a job runs. An image
from an allowed registry (`--allowed-registries`) is pulled by its registry name and run by the id
the pull gave. Anything else is refused the same way whether it was published to another tenant or
never published: a tenant learns nothing of another's images.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from computepool.core.errors import InvalidInput
from computepool.core.images import parse_image, registry_allowed
from computepool.server.context import Ctx
from computepool.server.errors import Invalid, NotFound
from computepool.server.logic.audit import record
from computepool.server.policy import authorize
from computepool.server.settings import ServerSettings
from computepool.store import images as store
from computepool.store import tenants as tenant_store
from computepool.store.db import db_now
from computepool.store.models import Image
from computepool.wire.common import Items
from computepool.wire.images import ImageOut, ImagePublish


def pin(s: Session, settings: ServerSettings, tenant: str, tenant_id: int, req: dict[str, Any]) -> None:
    """Set `req["image_digest"]` to the image the tenant's job will run; Invalid if it may run none."""
    ref = req.get("image")
    if ref is None:
        return
    name = parse_image(ref)
    image = store.get(s, name.canonical)
    if image is not None and store.may_run(s, image, tenant_id):
        req["image_digest"] = image.digest
        return
    if registry_allowed(name, settings.allowed_registries):
        req.pop("image_digest", None)  # the node pulls it by name and runs the id the pull gives
        return
    raise Invalid(
        f"image: {ref} is not an image tenant '{tenant}' may run: an admin publishes images "
        "(cpool images publish) or allows their registry (cpool server --allowed-registries)",
        "image",
    )


def _out(image: Image, tenants: list[str] | None) -> ImageOut:
    return ImageOut(
        name=image.name,
        digest=image.digest,
        tenants=None if image.all_tenants else tenants,
        published_by=image.published_by,
        created_at=image.created_at,
    )


def publish(ctx: Ctx, body: ImagePublish) -> ImageOut:
    with ctx.db.write() as s:
        ids: list[int] | None = None
        if body.tenants is not None:
            ids = []
            for i, name in enumerate(body.tenants):
                t = tenant_store.get(s, name)
                if t is None:
                    raise NotFound.of("tenant", name, f"tenants.{i}")
                ids.append(t.id)
        now = db_now(s)
        image = store.publish(s, body.name, body.digest, ids, ctx.caller().actor, now)
        tenants = sorted(set(body.tenants or ()))
        detail = {"digest": image.digest, "tenants": tenants or "all"}
        record(s, ctx, f"image:{image.name}", detail=detail, now=now)
        return _out(image, tenants)


def list_all(ctx: Ctx) -> Items[ImageOut]:
    """Admins see every image and whom it is for; a tenant's users see the images their tenant may run."""
    caller = ctx.caller()
    scope = authorize(caller, ctx.action)
    with ctx.db.read() as s:
        tenant_id = None
        if scope.tenant is not None:
            t = tenant_store.get(s, scope.tenant)
            if t is None:
                return Items(items=[])
            tenant_id = t.id
        found = store.list_all(s, tenant_id)
        grants = store.tenants_of(s, [i.id for i in found])
        return Items(
            items=[_out(i, grants[i.id] if tenant_id is None else [scope.tenant or ""]) for i in found]
        )


def unpublish(ctx: Ctx, name: str) -> ImageOut:
    try:
        canonical = parse_image(name, "name").canonical
    except InvalidInput as e:
        raise Invalid(f"{e.where}: {e.message}", e.where) from None
    with ctx.db.write() as s:
        image = store.get(s, canonical)
        if image is None:
            raise NotFound.of("image", name)
        out = _out(image, store.tenants_of(s, [image.id])[image.id])
        store.unpublish(s, image)
        record(s, ctx, f"image:{canonical}", detail={"unpublished": image.digest})
        return out
