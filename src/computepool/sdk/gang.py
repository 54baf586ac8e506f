"""A function over several nodes: each call is one gang allocation, its members one compute domain.

The functions queue hands calls to single-node workers; a call that needs N nodes at once is an
allocation instead (`gang_nodes=N`, the options per node), bound all-or-nothing and started on all
members together, each with the gang's environment (MASTER_ADDR, WORLD_SIZE, RANK, …), so
`torch.distributed.init_process_group()` works inside the function as under `torchrun`. Its code is
the function's archive; the call's pickled arguments are the allocation's stdin; every member runs
`__cpool__/worker.py --once`, which writes the outcome to `__cpool__/outcome.json` in its work dir.
The caller streams rank 0's stdout and stderr while the gang runs, then fetches every member's
outcome (file requests by rank): rank 0's value (or all ranks' with `all_ranks=True`), or the
exception of the lowest rank that raised, with its remote traceback.
"""

from __future__ import annotations

import base64
import contextlib
import json
import sys
import tarfile
import time
from collections.abc import Iterator, Mapping, Sequence
from io import BytesIO
from typing import TYPE_CHECKING, Any, TypeVar

import cloudpickle

from computepool.client.errors import PoolError
from computepool.sdk import pool as pool_mod
from computepool.sdk.errors import CallCancelled, IncompatiblePython, RemoteError, RemoteTraceback
from computepool.wire.allocations import AllocationCreate

if TYPE_CHECKING:
    from computepool.sdk.pool import RemoteFunction

R = TypeVar("R")
OUTCOME_PATH = "__cpool__/outcome.json"  # in each member's work dir (worker.py writes it)
PYTHON_LABEL = "cpool.io/python-{}"  # the label the control plane gives nodes per reported Python
LOG_WAIT_S = 20.0
FILE_WAIT_S = 10.0
FETCH_TIMEOUT_S = 120.0
ENDED = frozenset({"released", "failed", "cancelled"})


def prepare(fn: RemoteFunction[Any, Any]) -> AllocationCreate:
    """Ship the code once and build the request every call's gang is made of. The caller's Python
    must be one the ready nodes provide (checked here, as the functions API checks its own)."""
    python, request = fn.shipped("--once")
    selector = dict(request.node_selector or {})
    if not fn.spec.request.image:  # in an image, the image's Python runs the worker
        _check_python(fn, python)
        selector[PYTHON_LABEL.format(python)] = "yes"
    name = "fn-" + (fn.spec.name or pool_mod.default_name(fn.fn))
    return request.changed(name=name[:63], node_selector=selector or None, restartable=False)


def _check_python(fn: RemoteFunction[Any, Any], python: str) -> None:
    nodes = fn.pool.client.list_nodes()
    provided = {v for n in nodes if n.get("state") == "ready" for v in (n.get("pythons") or [])}
    if python in provided:
        return
    offer = (
        "provide " + ", ".join(sorted(provided, key=lambda v: tuple(int(p) for p in v.split("."))))
        if provided
        else "report no Python version (no ready node, or agents too old to say)"
    )
    raise IncompatiblePython(f"this function needs Python {python} (the caller's); the pool's nodes {offer}")


def start(fn: RemoteFunction[Any, R], args: tuple[Any, ...], kwargs: dict[str, Any]) -> GangHandle[R]:
    """One call: its arguments as a blob, then its gang allocation."""
    request = fn.gang_request()
    stdin = fn.pool.client.put_blob(pool_mod.pack_call(args, kwargs))
    alloc = fn.pool.client.create_allocation(request.changed(stdin=stdin))
    return GangHandle(fn, int(alloc["id"]), request.gang_nodes)


class GangHandle(pool_mod.Handle[R]):
    """One call over several nodes: `.id` is its allocation; `.result(timeout=)`, `.cancel()`."""

    def __init__(self, fn: RemoteFunction[Any, R], alloc_id: int, ranks: int) -> None:
        super().__init__(fn, alloc_id)
        self.ranks = ranks
        self.allocation: dict[str, Any] = {}

    def poll(self, wait_s: float) -> None:
        """One long-poll of rank 0's output: written to our stdout and stderr; settled once ended."""
        client, wait = self.fn.pool.client, round(max(0.0, min(wait_s, LOG_WAIT_S)), 3)
        out = self.fn.pool.rider.call(
            lambda: client.allocation_logs(self.id, self.offset, self.err_offset, rank=0, wait=wait)
        )
        for name, fd in (("stdout", sys.stdout), ("stderr", sys.stderr)):
            part = out.get(name) or {}
            data = str(part.get("data") or "")
            if data:
                fd.write(data)
                fd.flush()
        self.offset = int((out.get("stdout") or {}).get("next", self.offset))
        self.err_offset = int((out.get("stderr") or {}).get("next", self.err_offset))
        self.state = str(out.get("state") or self.state)
        if out.get("ended"):
            self.allocation = self.fn.pool.rider.call(lambda: client.get_allocation(self.id))
            self.outcome = {"outcomes": self._outcomes()}

    def result(self, timeout: float | None = None) -> R:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.outcome is None:
            left = LOG_WAIT_S if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"allocation {self.id} ({self.fn.name} on {self.ranks} nodes) "
                    f"did not end within {timeout:g} s"
                )
            self.poll(left)
        return self._settle_gang(self.outcome["outcomes"])

    def cancel(self) -> None:
        """Cancel the call's allocation (its members are stopped); an ended one is left as it is."""
        if self.ended:
            return
        try:
            self.fn.pool.client.cancel_allocation(self.id)
        except PoolError as e:
            if e.status != 409:  # it ended meanwhile
                raise

    def _outcomes(self) -> dict[int, dict[str, Any]]:
        """Each member's outcome file, by rank (absent: the member never wrote one)."""
        if self.allocation.get("state") == "cancelled" or not self.allocation.get("nodes"):
            return {}
        return fetch_outcomes(self.fn.pool.client, self.id, len(self.allocation["nodes"]))

    def _settle_gang(self, outcomes: Mapping[int, Mapping[str, Any]]) -> R:
        a = self.allocation
        where = f"allocation {self.id}"
        if a.get("state") == "cancelled":
            raise CallCancelled(f"{where} was cancelled: {a.get('reason') or 'no reason given'}")
        failed = sorted(r for r, o in outcomes.items() if not o.get("ok"))
        if failed:
            rank = failed[0]
            _raise(outcomes[rank], self.fn, f"{where}, rank {rank} of {self.ranks}")
        missing = [r for r in range(self.ranks) if r not in outcomes]
        if missing:
            ranks = ", ".join(str(r) for r in missing)
            raise RemoteError(
                f"{where} {a.get('state')}: {a.get('reason') or 'no reason given'} "
                f"(no outcome from rank{'s' if len(missing) > 1 else ''} {ranks})"
            )
        values = [_load(outcomes[r], f"{where}, rank {r}") for r in range(self.ranks)]
        return values if self.fn.spec.all_ranks else values[0]  # type: ignore[return-value]

    def __repr__(self) -> str:
        return f"<GangHandle allocation {self.id} of {self.fn.name} on {self.ranks} nodes: {self.state}>"


def fetch_outcomes(client: Any, alloc_id: int, ranks: int) -> dict[int, dict[str, Any]]:
    """Ask every member's node for its outcome at once, then collect the answers."""
    asked: dict[int, Mapping[str, Any]] = {}
    for rank in range(ranks):
        with contextlib.suppress(PoolError):  # e.g. a member's node left the pool: no outcome
            asked[rank] = client.request_files(alloc_id, OUTCOME_PATH, rank)
    deadline = time.monotonic() + FETCH_TIMEOUT_S
    out: dict[int, dict[str, Any]] = {}
    for rank, req in asked.items():
        with contextlib.suppress(PoolError):
            while req.get("state") == "pending" and time.monotonic() < deadline:
                left = deadline - time.monotonic()
                req = client.get_file_request(alloc_id, int(req["id"]), wait=min(FILE_WAIT_S, left))
            if req.get("state") == "done" and req.get("blob"):
                found = _read_outcome(client.get_blob(str(req["blob"])))
                if found is not None:
                    out[rank] = found
    return out


def _read_outcome(packed: bytes) -> dict[str, Any] | None:
    """The outcome file out of the tar(.gz) a file request answers with (read in memory, never extracted)."""
    try:
        with tarfile.open(fileobj=BytesIO(packed), mode="r:*") as tar:
            member = tar.getmember(OUTCOME_PATH)
            f = tar.extractfile(member) if member.isfile() else None
            data = json.loads(f.read()) if f is not None else None
    except (tarfile.TarError, KeyError, OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _load(o: Mapping[str, Any], where: str) -> Any:
    try:
        return cloudpickle.loads(base64.b64decode(str(o.get("result") or "")))
    except Exception as e:  # noqa: BLE001 - e.g. a class this caller cannot import
        what = "result" if o.get("ok") else "exception"
        detail = f"\n{o['traceback']}" if o.get("traceback") else ""
        raise RemoteError(f"{where}: its {what} could not be read here ({e}){detail}") from None


def _raise(o: Mapping[str, Any], fn: RemoteFunction[Any, Any], where: str) -> None:
    value = _load(o, where)
    if not isinstance(value, BaseException):
        raise RemoteError(f"{where} failed with a non-exception: {value!r}")
    tb = pool_mod.localise(str(o.get("traceback") or ""), fn.fn)
    value.add_note(f"(raised on the pool, in {where}, of {fn.name})")
    raise value from RemoteTraceback(tb) if tb else None


def ordered(
    handles: Sequence[pool_mod.Handle[Any]], return_exceptions: bool, timeout: float | None
) -> Iterator[Any]:
    """A map's results in order, each gang waited for in turn (they all run meanwhile)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for i, h in enumerate(handles):
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            value = h.result(timeout=left)
        except KeyboardInterrupt:  # Ctrl-C stops the map's work on the pool too
            for rest in handles[i:]:
                with contextlib.suppress(Exception):
                    rest.cancel()
            raise
        except TimeoutError:
            if h.ended:  # the function's own TimeoutError
                if not return_exceptions:
                    raise
                yield sys.exc_info()[1]
                continue
            raise TimeoutError(
                f"map: call {i} (of {len(handles)}) did not end within {timeout:g} s"
            ) from None
        except Exception as e:
            if not return_exceptions:
                raise
            yield e
            continue
        yield value
