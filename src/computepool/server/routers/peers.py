"""LAN discovery: the pool's discovery key for nodes, the peers each node reports, `cpool peers`."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter(tags=["peers"])
