"""Job arrays, dependencies and retries on the command line: the options' parsing, an id that names a
whole array (its first member's id) or one member (`ARRAY_INDEX`, or the member's own id), and
following every member's output at once, each line prefixed `[INDEX]`.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

from computepool.cli.common import err_console
from computepool.cli.logstream import ended_line, exit_code, follower
from computepool.client import PoolClient
from computepool.core.errors import InvalidInput
from computepool.wire.allocations import parse_array

PAUSE_S = 0.3
MAX_MEMBERS = 10_000


def array_option(spec: str | None) -> str | None:
    """The --array spec, checked here so a bad one is one line, not a server round trip."""
    if spec is None:
        return None
    try:
        parse_array(spec)
    except ValueError as e:
        raise InvalidInput("--array", str(e)) from None
    return spec


def after_option(values: list[str] | None) -> list[dict[str, Any]] | None:
    """--after ID[:ok|:any|:failed], as the request's `after`."""
    out: list[dict[str, Any]] = []
    for v in values or []:
        ident, _, on = v.partition(":")
        if not ident.isdigit() or on not in ("", "ok", "any", "failed"):
            raise InvalidInput("--after", f"{v!r}: give ID, ID:ok, ID:any or ID:failed")
        out.append({"id": int(ident), "on": on or "ok"})
    return out or None


def codes_option(text: str | None) -> list[int] | None:
    """--retry-on-exit 1,137, as the request's `retry_on_exit`."""
    if text is None:
        return None
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() and 1 <= int(p) <= 255 for p in parts):
        raise InvalidInput("--retry-on-exit", f"{text!r}: give exit codes 1..255 separated by commas")
    return [int(p) for p in parts]


def members(pool: PoolClient, array_id: int) -> list[dict[str, Any]]:
    """The array's members in index order."""
    items = pool.list_allocations(limit=MAX_MEMBERS, array=array_id)
    return sorted(items, key=lambda a: int(a.get("array_index") or 0))


def resolve(pool: PoolClient, ident: str) -> tuple[list[str], bool]:
    """The allocation ids `ident` names, and whether it names a whole array: an array's id (its
    first member's) names every member; `ARRAY_INDEX` one member; any other id itself."""
    head, sep, index = ident.partition("_")
    if sep:
        if not (head.isdigit() and index.isdigit()):
            raise InvalidInput("ID", f"{ident!r}: give an allocation id, or ARRAY_INDEX for one member")
        found = [m for m in members(pool, int(head)) if m.get("array_index") == int(index)]
        if not found:
            raise InvalidInput("ID", f"array {head} has no member with index {index}")
        return [str(found[0]["id"])], False
    a = pool.get_allocation(ident)
    if a.get("array_id") is not None and a.get("array_id") == a.get("id"):
        return [str(m["id"]) for m in members(pool, int(a["id"]))], True
    return [ident], False


@dataclass
class _Member:
    id: str
    index: int
    offsets: dict[str, int] = field(default_factory=lambda: {"stdout": 0, "stderr": 0})
    partial: dict[str, str] = field(default_factory=lambda: {"stdout": "", "stderr": ""})
    last: dict[str, Any] | None = None


def _emit(m: _Member, stream: str, fd: TextIO, data: str, *, flush: bool = False) -> None:
    text = m.partial[stream] + data
    lines = text.split("\n")
    m.partial[stream] = "" if flush else lines.pop()
    out = "".join(f"[{m.index}] {line}\n" for line in lines if line or not flush)
    if out:
        fd.write(out)
        fd.flush()


def copy_members(
    pool: PoolClient, array_id: int, *, follow: bool = True, only: list[str] | None = None
) -> list[dict[str, Any]]:
    """Copy every member's output (of those in `only`, if given), each line prefixed `[INDEX]`;
    with `follow`, until every member ended and all is out. Returns each member's last answer."""
    rider = follower(f"array {array_id}") if follow else None
    todo = {
        str(a["id"]): _Member(str(a["id"]), int(a.get("array_index") or 0))
        for a in members(pool, array_id)
        if only is None or str(a["id"]) in only
    }
    done: list[_Member] = []
    while todo:
        states = {str(a["id"]): a["state"] for a in members(pool, array_id)} if follow else {}
        moved = False
        for m in list(todo.values()):
            if states.get(m.id) == "pending":
                continue  # nothing to read yet; its state is checked again next round

            def read(m: _Member = m) -> dict[str, Any]:
                return pool.allocation_logs(m.id, m.offsets["stdout"], m.offsets["stderr"])

            out = rider.call(read) if rider is not None else read()
            got = False
            for stream, fd in (("stdout", sys.stdout), ("stderr", sys.stderr)):
                part = out.get(stream) or {}
                _emit(m, stream, fd, str(part.get("data") or ""))
                nxt = int(part.get("next", m.offsets[stream]))
                got = got or nxt > m.offsets[stream]
                m.offsets[stream] = nxt
            moved = moved or got
            if out.get("ended") or (not follow and not got):  # without follow: every stored page
                for stream, fd in (("stdout", sys.stdout), ("stderr", sys.stderr)):
                    _emit(m, stream, fd, "", flush=True)
                m.last = out
                done.append(todo.pop(m.id))
        if todo and not moved:
            time.sleep(PAUSE_S)
    return [m.last or {} for m in sorted(done, key=lambda m: m.index)]


def array_exit(array_id: int, outs: list[dict[str, Any]], ids: list[str]) -> int:
    """0 when every member ended well; else the first failed member's exit code (each failure said)."""
    code = 0
    for ident, out in zip(ids, outs, strict=False):
        mine = exit_code(out)
        if out.get("state") != "released" or mine != 0:
            err_console.print(ended_line(ident, out), highlight=False, markup=False, soft_wrap=True)
            code = code or mine or 1
    return code


def follow_array(pool: PoolClient, array_id: int) -> int:
    """`cpool run --array`: every member's output, then the exit code `array_exit` gives."""
    ids = [str(m["id"]) for m in members(pool, array_id)]
    err_console.print(
        f"array {array_id}: {len(ids)} jobs (ids {ids[0]}..{ids[-1]}); `cpool cancel {array_id}` "
        "cancels them all",
        highlight=False,
        markup=False,
        style="dim",
    )
    outs = copy_members(pool, array_id)
    return array_exit(array_id, outs, ids)
