"""`PoolClient`'s blob and file-request calls: upload code and stdin, fetch a job's files back.

A mixin so that http.py keeps the plumbing and this keeps the raw-bytes calls (bodies that are
not JSON). Uploads ask `HEAD /blobs/{sha}` first: bytes the tenant holds already are not sent.
"""

from __future__ import annotations

import hashlib
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import httpx

from computepool.client.errors import PoolError

if TYPE_CHECKING:
    from collections.abc import Mapping

API = "/api/v1"
UPLOAD_TIMEOUT_S = 600.0
FILES_WAIT_S = 20.0


class BlobMethods:
    """Mixed into PoolClient (which provides `server`, `timeout`, `send` and `request`)."""

    timeout: float

    if TYPE_CHECKING:

        @property
        def server(self) -> str: ...  # PoolClient's

        def send(
            self,
            method: str,
            url: str,
            *,
            headers: dict[str, str] | None = None,
            timeout: float | None = None,
            **kw: Any,
        ) -> httpx.Response: ...  # PoolClient's

        def request(
            self,
            method: str,
            path: str,
            *,
            json: object = None,
            params: Mapping[str, Any] | None = None,
            headers: Mapping[str, str] | None = None,
            api: bool = True,
        ) -> Any: ...  # PoolClient's

    def _raw(
        self, method: str, path: str, *, content: bytes | None = None, timeout: float | None = None
    ) -> httpx.Response:
        from computepool.client.http import error_from_response  # noqa: PLC0415 - cycle

        r = self.send(method, API + path, content=content, timeout=timeout)
        if r.status_code == 404 and method == "HEAD":
            return r
        if not r.is_success:
            raise error_from_response(r)
        return r

    def has_blob(self, sha: str) -> bool:
        """Whether the caller's tenant holds these bytes already (HEAD /blobs/{sha})."""
        return self._raw("HEAD", f"/blobs/{quote(sha, safe='')}").status_code == 200

    def put_blob(self, data: bytes) -> str:
        """Upload `data` unless the tenant holds it already; its sha256 (hex)."""
        return self.put_blob_info(data)[0]

    def put_blob_info(self, data: bytes) -> tuple[str, bool]:
        """`put_blob`, and whether the bytes had to be sent (False: already on the pool).

        Over a cap the server says so in its answer to HEAD: refused here with its sizes, unsent."""
        sha = sha256_hex(data)
        head = self._raw("HEAD", f"/blobs/{sha}")
        if head.status_code == 200:
            return sha, False
        _check_room(len(data), head.headers)
        self._raw("PUT", f"/blobs/{sha}", content=data, timeout=max(self.timeout, UPLOAD_TIMEOUT_S))
        return sha, True

    def get_blob(self, sha: str) -> bytes:
        """The blob's bytes, checked against their hash."""
        r = self._raw("GET", f"/blobs/{quote(sha, safe='')}", timeout=max(self.timeout, UPLOAD_TIMEOUT_S))
        data = r.content
        if sha256_hex(data) != sha:
            raise PoolError(
                0, f"blob {sha[:16]}… came back with other bytes (sha256 {sha256_hex(data)[:16]}…)"
            )
        return data

    def request_files(self, alloc_id: int | str, path: str, rank: int | None = None) -> Mapping[str, Any]:
        """Ask the job's node for `path` (relative to the job's work dir)."""
        body: dict[str, Any] = {"path": path}
        if rank is not None:
            body["rank"] = rank
        return dict(self.request("POST", f"/allocations/{quote(str(alloc_id), safe='')}/files", json=body))

    def get_file_request(self, alloc_id: int | str, rid: int, wait: float = 0.0) -> Mapping[str, Any]:
        params = {"wait": wait} if wait > 0 else None
        return dict(
            self.request("GET", f"/allocations/{quote(str(alloc_id), safe='')}/files/{rid}", params=params)
        )

    def fetch_files(
        self, alloc_id: int | str, path: str, *, rank: int | None = None, timeout: float = 120.0
    ) -> bytes:
        """The tar.gz of `path` from the job's work dir (waits for the node's agent to pack it)."""
        req = self.request_files(alloc_id, path, rank)
        deadline = time.monotonic() + timeout
        while req.get("state") == "pending":
            left = deadline - time.monotonic()
            if left <= 0:
                raise PoolError(
                    504, f"node {req.get('node')} did not answer the file request within {timeout:g} s"
                )
            req = self.get_file_request(alloc_id, int(req["id"]), wait=min(FILES_WAIT_S, left))
        if req.get("state") != "done" or not req.get("blob"):
            raise PoolError(422, f"{path}: {req.get('error') or 'the node could not send it'}", "path")
        return self.get_blob(str(req["blob"]))

    def download(
        self,
        alloc_id: int | str,
        path: str,
        dest: Path,
        *,
        rank: int | None = None,
        left_out: list[str] | None = None,
    ) -> Path:
        """`path` of the job (a file or a directory) to `dest`, like `cp`: into `dest` when it is a
        directory, else as `dest`. Returns where it landed; ValueError where a file would replace a
        directory (or the other way). Links in it that lead out of the job's
        work dir (and fifos, devices) are not brought back: their names go to `left_out`."""
        from computepool.core.tarsafe import UnsafeArchive, extract  # noqa: PLC0415 - tarfile: only here

        data = self.fetch_files(alloc_id, path, rank=rank)
        dest = dest.expanduser()
        target = dest / Path(path).name if dest.is_dir() else dest
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".cpool-cp-") as tmp:
            try:
                verdict = extract(data, Path(tmp), links_out="skip")
            except UnsafeArchive as e:
                raise PoolError(422, f"{path}: refused the files sent back: {e}") from None
            if left_out is not None:
                left_out.extend(sorted(verdict.left_out))
            got = Path(tmp) / path
            if not got.exists() and not got.is_symlink():
                if path.strip("/") in {n.strip("/") for n in verdict.left_out}:  # the path is such a link
                    why = "a link leading outside the job's work dir (or a special file): not brought back"
                    raise PoolError(422, f"{path}: {why}", "path")
                raise PoolError(422, f"{path}: not in the files sent back", "path")
            _place(got, target)
        return target


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _check_room(size: int, headers: Mapping[str, str]) -> None:
    """413 before sending, from the caps the server gave with its HEAD answer (when it gave them)."""
    try:
        cap = int(headers.get("X-Blob-Max-Bytes", "0"))
        used = int(headers.get("X-Tenant-Blob-Used-Bytes", "0"))
        tenant_cap = int(headers.get("X-Tenant-Blob-Max-Bytes", "0"))
    except ValueError:
        return
    if cap and size > cap:
        raise PoolError(
            413,
            f"blob of {_mib(size)} is over the per-upload cap of {_mib(cap)} (the server's --blob-max-mib)",
        )
    if tenant_cap and used + size > tenant_cap:
        raise PoolError(
            413,
            f"the tenant holds {_mib(used)} of blobs; {_mib(size)} more would pass its cap of "
            f"{_mib(tenant_cap)} (the server's --tenant-blob-max-mib)",
        )


def _place(got: Path, target: Path) -> None:
    """`got` moved to `target` as `cp -r` would: a directory merged into an existing one, a file
    replacing a file; a directory never replaced by a file nor the other way (ValueError, one line)."""
    got_dir = got.is_dir() and not got.is_symlink()
    there = target.exists() or target.is_symlink()
    target_dir = target.is_dir()  # a link to a directory counts as one, as for cp
    if there and target_dir and not got_dir:
        raise ValueError(f"cannot overwrite directory {target} with a file")
    if there and got_dir and not target_dir:
        raise ValueError(f"cannot overwrite non-directory {target} with a directory")
    if got_dir and target_dir:
        _merge(got, target)
    else:
        got.replace(target)


def _merge(src: Path, dst: Path) -> None:
    """Move `src`'s entries into the existing directory `dst` (files replace files); raises
    ValueError where a directory and a file meet, after moving whatever came before."""
    for entry in sorted(src.iterdir()):
        _place(entry, dst / entry.name)
