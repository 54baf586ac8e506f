"""Answering a hot route with its model serialised in place.

FastAPI checks a route's returned model against its response model again before serialising it,
and for a plain (sync) route it does so in one more worker-thread hop; on the routes every job
passes through (submit, a node's reports, assignments and output) that cost about as much as the
route's own work. A model the route built is already valid, so these routes return it as JSON
themselves; `response_model` on the route keeps the API document as it was.
"""

from __future__ import annotations

from fastapi import Response
from pydantic import BaseModel


def answer(model: BaseModel, response: Response, status_code: int = 200) -> Response:
    """`model` as FastAPI would send it (by alias, as JSON), with the status and headers the route
    and its dependencies set on `response` (e.g. a browser session's no-store)."""
    out = Response(
        model.model_dump_json(by_alias=True),
        status_code=response.status_code or status_code,
        media_type="application/json",
    )
    out.raw_headers.extend(
        (k, v) for k, v in response.raw_headers if k not in (b"content-length", b"content-type")
    )
    return out
