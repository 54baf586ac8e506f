"""Blobs (PUT/HEAD/GET by sha256) and file requests (a job's files back): users' and agents' routes.

Bodies of `PUT /blobs/{sha256}` and `PUT /nodes/{name}/files/{rid}` are raw bytes, streamed to
disk; the app's body-size cap lets them through up to the blob cap (see `RAW_UPLOADS`).
"""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.responses import FileResponse

from computepool.server import topics
from computepool.server.context import Ctx
from computepool.server.deps import requires
from computepool.server.errors import NotFound
from computepool.server.hub import Hub
from computepool.server.logic import blobs
from computepool.server.policy import Action
from computepool.server.routers.allocations import MAX_WAIT_S, get_hub
from computepool.server.routers.polling import long_poll
from computepool.wire.blobs import BlobOut, FileFailure, FileRequestCreate, FileRequestOut

router = APIRouter(tags=["blobs"])
# Routes whose raw bodies the blob caps govern instead of --max-body-bytes (method, path pattern).
RAW_UPLOADS = re.compile(r"^/api/v1/(blobs/[^/]+|nodes/[^/]+/files/[0-9]+)$")
ContentLength = Annotated[int | None, Header(alias="Content-Length", ge=0, include_in_schema=False)]


@router.put(
    "/blobs/{sha256}",
    status_code=201,
    summary="Upload bytes by their sha256 (201 new; 200 held already; 413 over a cap)",
    responses={200: {"description": "The tenant held these bytes already"}},
)
async def put_blob(
    sha256: str,
    request: Request,
    response: Response,
    ctx: Annotated[Ctx, Depends(requires(Action.BLOB_PUT))],
    content_length: ContentLength = None,
) -> BlobOut:
    out, created = await blobs.put(ctx, sha256, content_length, request.stream())
    response.status_code = 201 if created else 200
    return out


@router.head("/blobs/{sha256}", summary="200 if the caller may read the blob, else 404")
def head_blob(sha256: str, ctx: Annotated[Ctx, Depends(requires(Action.BLOB_GET))]) -> Response:
    """A 404 carries the caller's room under the caps, so a client can refuse an upload unsent."""
    try:
        _path, size = blobs.locate(ctx, sha256, own=True)
    except NotFound:
        return Response(status_code=404, headers=blobs.room_headers(ctx))
    return Response(status_code=200, headers={"Content-Length": str(size)})


@router.get("/blobs/{sha256}", summary="The blob's bytes (the tenant's users; nodes running work naming it)")
def get_blob(sha256: str, ctx: Annotated[Ctx, Depends(requires(Action.BLOB_GET))]) -> FileResponse:
    path, _size = blobs.locate(ctx, sha256)
    return FileResponse(path, media_type="application/octet-stream")


@router.post(
    "/allocations/{alloc_id}/files",
    status_code=201,
    summary="Ask for a file or directory from the job's work dir (its node's agent packs it)",
)
def request_files(
    alloc_id: int,
    body: FileRequestCreate,
    ctx: Annotated[Ctx, Depends(requires(Action.FILE_REQUEST))],
    hub: Annotated[Hub, Depends(get_hub)],
) -> FileRequestOut:
    return blobs.request_files(ctx, alloc_id, body, hub)


@router.get(
    "/allocations/{alloc_id}/files/{rid}",
    summary="A file request: pending, done (with its blob) or failed (long-poll with wait)",
)
async def get_file_request(
    alloc_id: int,
    rid: int,
    ctx: Annotated[Ctx, Depends(requires(Action.FILE_GET))],
    hub: Annotated[Hub, Depends(get_hub)],
    wait: Annotated[float, Query(ge=0, le=MAX_WAIT_S, description="Seconds to wait while pending.")] = 0,
) -> FileRequestOut:
    return await long_poll(
        hub,
        topics.files(rid),
        wait,
        lambda: blobs.get_file_request(ctx, alloc_id, rid),
        lambda out: out.state != "pending",
    )


@router.put("/nodes/{name}/files/{rid}", summary="The packed files of a request (node credential)")
async def answer_files(
    name: str,
    rid: int,
    request: Request,
    ctx: Annotated[Ctx, Depends(requires(Action.NODE_FILE_ANSWER))],
    hub: Annotated[Hub, Depends(get_hub)],
    content_length: ContentLength = None,
) -> FileRequestOut:
    return await blobs.answer(ctx, name, rid, content_length, request.stream(), hub)


@router.post("/nodes/{name}/files/{rid}/failed", summary="Why a file request cannot be answered (node)")
def fail_files(
    name: str,
    rid: int,
    body: FileFailure,
    ctx: Annotated[Ctx, Depends(requires(Action.NODE_FILE_ANSWER))],
    hub: Annotated[Hub, Depends(get_hub)],
) -> FileRequestOut:
    return blobs.fail(ctx, name, rid, body.error, hub)
