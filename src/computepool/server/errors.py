"""API errors and their JSON shape: `{"error": message, "field": where}` — never a 500 for bad input.

Services raise `ApiError` subclasses; handlers here turn them, validation errors and database
outages into answers. A database that cannot be reached gives 503 with Retry-After; the engine's
pre-ping replaces dead connections, so the server recovers by itself when the database returns.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException

from computepool.server.outage import disk_full

log = logging.getLogger("computepool.server")


class ApiError(Exception):
    status = 400

    def __init__(self, message: str, field: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.headers = headers or {}


class Unauthorized(ApiError):
    status = 401

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"WWW-Authenticate": "Bearer"})


class Forbidden(ApiError):
    status = 403


class NotFound(ApiError):
    """A missing object, and equally another tenant's: one wording, so answers never tell them apart."""

    status = 404

    @classmethod
    def of(cls, kind: str, name: object, field: str | None = None) -> NotFound:
        return cls(not_found(kind, name), field)


def not_found(kind: str, name: object) -> str:
    """The one wording of a 404: `allocation '7' not found` whether it is missing or not the caller's."""
    return f"{kind} '{name}' not found"


class Conflict(ApiError):
    status = 409


class Invalid(ApiError):
    status = 422


class InsufficientStorage(ApiError):
    """The server's disk is full where the request would write (the message names which store)."""

    status = 507


class TooManyRequests(ApiError):
    """Over a rate limit: retry after the seconds its Retry-After header says."""

    status = 429


def sqlite_file(url: str) -> str | None:
    """The file of a SQLite database URL (None for another database, or one in memory)."""
    if not url.startswith("sqlite"):
        return None
    name = make_url(url).database
    return name if name and name != ":memory:" else None


def store_of(settings: Any, filename: object) -> str:
    """Which of the server's stores holds `filename` (a path an OSError names), in words."""
    if not isinstance(filename, str | bytes | os.PathLike):
        return "disk"
    path = os.path.abspath(os.fsdecode(filename))
    db = sqlite_file(settings.database_url)
    places = [
        (str(settings.blobs_path), "blob store (--blob-dir)"),
        (os.path.dirname(os.path.abspath(db)) if db else "", "database"),
        (str(settings.data_dir), "data dir (--data-dir)"),
    ]
    for root, name in places:
        if root and (path == os.path.abspath(root) or path.startswith(os.path.abspath(root) + os.sep)):
            return name
    return f"disk at {path}"


def error_body(message: str, field: str | None = None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"error": message}
    if field is not None:
        body["field"] = field
    body.update(extra)
    return body


def field_path(loc: Sequence[int | str]) -> str:
    """('body', 'devices', 0, 'index') → 'devices[0].index'; the request part is dropped."""
    parts = list(loc)
    if parts and parts[0] in ("body", "query", "path", "header", "cookie"):
        head = parts.pop(0)
        if not parts:
            return str(head)
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _validation(errors: Sequence[Any]) -> dict[str, Any]:
    items = []
    for e in errors:
        if e.get("type") == "json_invalid":
            items.append(
                {"field": "body", "error": f"malformed JSON: {e.get('ctx', {}).get('error', e['msg'])}"}
            )
        else:
            message = str(e.get("msg", "invalid")).removeprefix("Value error, ")  # pydantic's, for our checks
            items.append({"field": field_path(e.get("loc", ())), "error": message})
    first = items[0] if items else {"field": "body", "error": "invalid request"}
    return error_body(f"{first['field']}: {first['error']}", first["field"], errors=items)


def install_handlers(app: FastAPI, on_denied: Any = None) -> None:
    """`on_denied(request, exc)` is called for refused state-changing calls (to audit them)."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        if on_denied is not None and exc.status in (403, 404, 409, 422):
            await on_denied(request, exc)
        return JSONResponse(error_body(exc.message, exc.field), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(_validation(exc.errors()), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail)), status_code=exc.status_code, headers=exc.headers)

    async def _db_down(request: Request, exc: Exception) -> JSONResponse:
        notes = getattr(request.app.state, "outage", None)
        if notes is not None:
            notes.failed(f"{request.method} {request.url.path}", exc)  # once per outage (outage.py)
        else:
            log.warning("database unavailable: %s", type(exc).__name__)
        settings = request.app.state.settings
        retry = str(settings.retry_after_s)
        if disk_full(exc, sqlite_file(settings.database_url)):  # refused whole; nothing stored is touched
            why = "the pool's database is out of disk space: nothing was stored; retry once there is room"
            return JSONResponse(error_body(why), status_code=507, headers={"Retry-After": retry})
        return JSONResponse(
            error_body("database unavailable, retry later"), status_code=503, headers={"Retry-After": retry}
        )

    for exc_type in (OperationalError, InterfaceError, PoolTimeout):
        app.add_exception_handler(exc_type, _db_down)

    @app.exception_handler(OSError)
    async def _os_error(request: Request, exc: OSError) -> JSONResponse:
        """A full disk under a store no route names itself: 507 naming where; anything else a 500,
        in JSON like every other answer (logged with its traceback)."""
        settings = request.app.state.settings
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            log.warning("%s %s: %s", request.method, request.url.path, exc)
            where = store_of(settings, exc.filename)
            why = (
                f"the server's {where} is out of disk space ({exc.strerror}): nothing was stored; "
                "retry once there is room"
            )
            return JSONResponse(
                error_body(why), status_code=507, headers={"Retry-After": str(settings.retry_after_s)}
            )
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return JSONResponse(error_body("internal server error (the server's log says more)"), status_code=500)

    @app.exception_handler(OverflowError)
    async def _overflow(request: Request, exc: OverflowError) -> JSONResponse:
        # a number too large for the database that a model let through: the caller's input, not ours
        log.warning("number out of range on %s: %s", request.url.path, exc)
        body = error_body("a number in the request is out of range (at most 2^63-1)")
        return JSONResponse(body, status_code=422)

    @app.exception_handler(IntegrityError)
    async def _conflict(request: Request, exc: IntegrityError) -> JSONResponse:
        return JSONResponse(error_body("conflicts with stored data (it may exist already)"), status_code=409)
