"""Published images: which image digest a name means, and which tenants may run it."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from computepool.store.models import Image, ImageTenant, Tenant


def get(session: Session, name: str) -> Image | None:
    return session.execute(select(Image).where(Image.name == name)).scalar_one_or_none()


def tenants_of(session: Session, image_ids: Sequence[int]) -> dict[int, list[str]]:
    """Per image id, the names of the tenants it was published to (sorted)."""
    rows = session.execute(
        select(ImageTenant.image_id, Tenant.name)
        .join(Tenant, Tenant.id == ImageTenant.tenant_id)
        .where(ImageTenant.image_id.in_(image_ids))
        .order_by(Tenant.name)
    ).all()
    out: dict[int, list[str]] = {i: [] for i in image_ids}
    for image_id, tenant in rows:
        out[image_id].append(tenant)
    return out


def list_all(session: Session, tenant_id: int | None = None) -> Sequence[Image]:
    """Every published image, or those `tenant_id` may run."""
    stmt = select(Image).order_by(Image.name)
    if tenant_id is not None:
        granted = select(ImageTenant.image_id).where(ImageTenant.tenant_id == tenant_id)
        stmt = stmt.where(Image.all_tenants | Image.id.in_(granted))
    return session.scalars(stmt).all()


def may_run(session: Session, image: Image, tenant_id: int) -> bool:
    if image.all_tenants:
        return True
    row = session.get(ImageTenant, (image.id, tenant_id))
    return row is not None


def publish(
    session: Session, name: str, digest: str, tenant_ids: Sequence[int] | None, by: str, now: datetime
) -> Image:
    """Pin `name` to `digest` for `tenant_ids` (None: all tenants), replacing what it meant before."""
    image = get(session, name)
    if image is None:
        image = Image(name=name)
        session.add(image)
    else:
        session.execute(delete(ImageTenant).where(ImageTenant.image_id == image.id))
    image.digest, image.all_tenants = digest, tenant_ids is None
    image.published_by, image.created_at = by, now
    session.flush()
    for tid in sorted(set(tenant_ids or ())):
        session.add(ImageTenant(image_id=image.id, tenant_id=tid))
    session.flush()
    return image


def unpublish(session: Session, image: Image) -> None:
    session.execute(delete(ImageTenant).where(ImageTenant.image_id == image.id))
    session.delete(image)
    session.flush()
