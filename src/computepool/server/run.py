"""Run the control plane under uvicorn."""

from __future__ import annotations

import logging

import uvicorn

from computepool.server.app import create_app
from computepool.server.settings import ServerSettings


def serve(settings: ServerSettings) -> None:
    logging.basicConfig(level=settings.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level)
