"""The web dashboard, served at / and /ui/… by the control plane (pages in `pages`, session in
`session`, templates and assets shipped in the package: nothing comes from the internet)."""

from __future__ import annotations

from computepool.server.web.pages import router

__all__ = ["router"]
