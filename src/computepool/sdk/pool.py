"""`Pool` and `@pool.function`: call a Python function on a slice of the pool as if it were local.

A decorated function registers itself with the control plane at its first remote call (one code
archive, content-addressed; the same spec answers the same function id), then each call is a row
the control plane hands to a worker: an allocation of the function's request that runs
`__cpool__/worker.py` (see worker.py). Results, exceptions and printed output come back through
`POST /functions/{id}/results`, long-polled with output offsets so printing streams as it happens.
A function over several nodes (`nodes=N`) takes another road: each call is one gang allocation
(see gang.py).
"""

from __future__ import annotations

import base64
import contextlib
import copy
import functools
import json
import linecache
import logging
import re
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, ParamSpec, TypeVar, overload

import cloudpickle

from computepool.client.config import resolve_config
from computepool.client.errors import PoolError
from computepool.client.follow import OutageRider, outage_wait_s
from computepool.client.http import PoolClient
from computepool.client.options import build_request, parse_secrets
from computepool.core.errors import InvalidInput
from computepool.core.servers import ServerArg
from computepool.sdk.errors import CallCancelled, IncompatiblePython, RemoteError, RemoteTraceback
from computepool.sdk.jobs import Job, job_request, ship_code
from computepool.sdk.packing import pack_call, pack_shipment, shipment
from computepool.wire.allocations import AllocationCreate

log = logging.getLogger("computepool.sdk")
P = ParamSpec("P")
R = TypeVar("R")

ENDED = frozenset({"done", "failed", "cancelled"})
BATCH = 1000  # calls per submission, ids per results poll (the API's limit)
POLL_S = 20.0
WINDOW = 256  # calls a map asks about at once: the next ones in order (less for the server to read)
MAP_POLL_GAP_S = 0.05  # a map's polls at most this often: results then come back in batches
SUBMIT_WAIT_S = 5.0  # `.remote()`'s submission waits this long for the result: one round trip
_BUILD_OPTIONS = frozenset(
    {"gpus", "gpu_mem", "cpus", "mem", "exclusive", "model", "isolation", "image", "ports", "mig"}
    | {"node_selector", "tolerations", "time_limit", "nodes"}
)
_SET_BY_BUILD = frozenset({"gang_nodes", "gpu_milli", "gpu_memory_mib", "cpu_milli", "memory_mib", "models"})
_OPTION_NAMES = _BUILD_OPTIONS | (set(AllocationCreate.model_fields) - _SET_BY_BUILD - {"command", "name"})
_NAME_BAD = re.compile(r"[^a-z0-9_.-]+")


def python_version() -> str:
    return f"{sys.version_info[0]}.{sys.version_info[1]}"


def default_name(fn: Callable[..., Any]) -> str:
    """A valid function name (lower case, [a-z0-9_.-], ≤ 60) from the function's qualified name."""
    raw = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", "function")
    name = _NAME_BAD.sub("-", str(raw).lower().replace("<locals>", "local")).strip("-._")
    return (name or "function")[:60]


class Pool:
    """The pool, as this caller's tenant: `Pool()` finds the server and token as the CLI does
    (arguments, else CPOOL_SERVER/CPOOL_TOKEN/CPOOL_CA, else what `cpool login` saved)."""

    def __init__(
        self,
        server: ServerArg = None,
        token: str | None = None,
        ca: str | None = None,
        timeout: float = 30.0,
        outage_wait: str | float | None = None,
    ) -> None:
        """`outage_wait`: how long results are waited for while the control plane is away (a
        duration such as `30m`, or seconds; 0: not at all), else $CPOOL_OUTAGE_WAIT, else 15 minutes."""
        wait_s = outage_wait_s(outage_wait, "outage_wait")
        cfg = resolve_config(server, token, ca=ca)
        self.client = PoolClient.from_config(cfg, timeout=max(timeout, POLL_S + 15))
        self.server = cfg.server
        # results are read again while the control plane restarts or fails over: the calls run on
        self.rider = OutageRider(wait_s, on_outage=lambda e: log.warning("%s; waiting for it", e))

    @overload
    def function(self, fn: Callable[P, R], /, **options: Any) -> RemoteFunction[P, R]: ...

    @overload
    def function(
        self, fn: None = None, /, **options: Any
    ) -> Callable[[Callable[P, R]], RemoteFunction[P, R]]: ...

    def function(
        self,
        fn: Callable[P, R] | None = None,
        /,
        *,
        pip: Sequence[str] | None = None,
        keep_warm: float = 0,
        max_workers: int = 8,
        name: str | None = None,
        env: dict[str, str] | None = None,
        secrets: Sequence[str] | None = None,
        all_ranks: bool = False,
        **options: Any,
    ) -> Any:
        """Decorate a function to run on the pool. `options` are `cpool alloc`'s (gpus, cpus, mem,
        gpu_mem, isolation, image, time_limit, …) per worker; `pip` its requirements;
        `keep_warm` the seconds an idle worker waits for the next call (0: one call per worker).
        `nodes=N` (N > 1): each call runs on N nodes at once as one gang (options per node), and
        answers rank 0's value, or every rank's in rank order with `all_ranks=True`. `secrets`: the
        tenant's secrets in each worker's environment, `NAME` or `NAME=VARIABLE` (`cpool secrets`)."""
        unknown = sorted(set(options) - _OPTION_NAMES)
        if unknown:
            raise InvalidInput(
                unknown[0], f"not an option of function() (options: {', '.join(sorted(_OPTION_NAMES))})"
            )
        if (
            isinstance(keep_warm, bool)
            or not isinstance(keep_warm, int | float)
            or not 0 <= keep_warm <= 86400
        ):
            raise InvalidInput("keep_warm", f"must be seconds from 0 to 86400, got {keep_warm!r}")
        if isinstance(max_workers, bool) or not isinstance(max_workers, int) or not 1 <= max_workers <= 256:
            raise InvalidInput("max_workers", f"must be a whole number from 1 to 256, got {max_workers!r}")
        if isinstance(pip, str):
            raise InvalidInput("pip", "expected a list of requirements, e.g. pip=['numpy'], not a string")
        if not isinstance(all_ranks, bool):
            raise InvalidInput("all_ranks", f"must be True or False, got {all_ranks!r}")
        request = build_request(flag="", **options)  # checks every option, naming the one at fault
        if secrets:
            request = request.changed(secrets=parse_secrets(secrets, "secrets"))
        if request.gang_nodes > 1 and keep_warm:
            raise InvalidInput(
                "keep_warm", "a call over several nodes starts its gang for itself: no warm workers"
            )
        spec = FunctionSpec(
            request=request,
            pip=tuple(str(p) for p in (pip or ())),
            keep_warm_s=int(round(keep_warm)),
            max_workers=max_workers,
            name=name,
            env=dict(env or {}),
            all_ranks=all_ranks,
        )

        def wrap(f: Callable[P, R]) -> RemoteFunction[P, R]:
            return RemoteFunction(self, f, spec)

        return wrap(fn) if fn is not None else wrap

    def run(
        self,
        command: str | Sequence[str],
        *,
        code: str | Path | None = None,
        env: dict[str, str] | None = None,
        secrets: Sequence[str] | None = None,
        array: str | None = None,
        after: Sequence[int | str | Job] | None = None,
        retries: int = 0,
        retry_on_exit: Sequence[int] | None = None,
        name: str | None = None,
        priority: int = 0,
        **options: Any,
    ) -> Job:
        """Submit a job, as `cpool run -d` does, and answer its `Job` (`.wait()`, `.logs()`, …).

        `command`: a string runs by `sh -c`, a list of words as given. `options` are `cpool run`'s
        (gpus, gpu_mem, cpus, mem, model, image, isolation, time_limit, nodes, …); `code` a directory
        shipped as the job's work dir (none by default); `after` Jobs or ids (`"ID:any"`)."""
        request = job_request(
            command, env=env, secrets=secrets, array=array, after=after, retries=retries,
            retry_on_exit=retry_on_exit, name=name, priority=priority, **options,
        )  # fmt: skip
        if code is not None:
            request = request.changed(code=ship_code(self.client, code))
        return Job(self.client, self.client.create_allocation(request), self.rider)

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> Any:
        raise TypeError("a Pool holds a connection: it cannot travel to the pool with a function")


@dataclass(frozen=True)
class FunctionSpec:
    request: AllocationCreate
    pip: tuple[str, ...]
    keep_warm_s: int
    max_workers: int
    name: str | None
    env: dict[str, str]
    all_ranks: bool = False

    @property
    def gang(self) -> bool:
        """Calls run as gang allocations (several nodes, or every rank's value asked for)."""
        return self.request.gang_nodes > 1 or self.all_ranks


class RemoteFunction(Generic[P, R]):
    """A function of the caller's that also runs on the pool: `.remote()`, `.spawn()`, `.map()`.
    Calling it directly still runs it here."""

    def __init__(self, pool: Pool, fn: Callable[P, R], spec: FunctionSpec) -> None:
        functools.update_wrapper(self, fn)
        self.pool = pool
        self.fn = fn
        self.name = str(getattr(fn, "__name__", "function"))
        self.spec = spec
        self.function_id: int | None = None
        self._gang_request: AllocationCreate | None = None
        self._lock = threading.Lock()

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.fn(*args, **kwargs)

    def __reduce__(self) -> Any:
        # referenced from another remote function: on the node it is the plain function
        return (copy.copy, (self.fn,))

    # ---- registration ------------------------------------------------------------------------

    def register(self) -> int:
        """Ship the code and register the function (once; the server answers the same id again)."""
        with self._lock:
            if self.function_id is None:
                self.function_id = self._register()
            return self.function_id

    def shipped(self, *worker_args: str) -> tuple[str, AllocationCreate]:
        """Upload the code archive; (the caller's Python, the request that runs the worker on it)."""
        s = self.spec
        ship = shipment(self.fn, Path.cwd())
        code = self.pool.client.put_blob(pack_shipment(ship))
        python = python_version()
        env = dict(s.env) | {"CPOOL_SYS_PATH": json.dumps(ship.sys_path)}
        if s.pip:
            env["CPOOL_PIP"] = json.dumps(sorted(s.pip))
        exe = "python3" if s.request.image else f"python{python}"
        command = [exe, "-u", "__cpool__/worker.py", *worker_args]
        return python, s.request.changed(command=command, env={**dict(s.request.env or {}), **env}, code=code)

    def gang_request(self) -> AllocationCreate:
        """The request of every call's gang (the code shipped once; see gang.py)."""
        from computepool.sdk import gang  # noqa: PLC0415 - gang.py builds on this module

        with self._lock:
            if self._gang_request is None:
                self._gang_request = gang.prepare(self)
            return self._gang_request

    def _register(self) -> int:
        s = self.spec
        python, worker = self.shipped()
        request = worker.body()
        body = {
            "name": s.name or default_name(self.fn),
            "request": request,
            "python": python,
            "keep_warm_s": s.keep_warm_s,
            "max_workers": s.max_workers,
        }
        try:
            answer = self.pool.client.request("POST", "/functions", json=body)
        except PoolError as e:
            if e.status == 422 and (e.field or "").split(".")[-1] == "python":
                raise IncompatiblePython(e.message) from None
            raise
        return int(answer["id"])

    # ---- calls -------------------------------------------------------------------------------

    def spawn(self, *args: P.args, **kwargs: P.kwargs) -> Handle[R]:
        """Start one call; its Handle gives the result (or raises the remote exception). Over several
        nodes, the Handle is the call's gang allocation (`.id` is its allocation id)."""
        return self._submit([(args, dict(kwargs))])[0]

    def remote(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """Run once on the pool and return the value; the remote exception is raised here as itself.
        Ctrl-C cancels the call."""
        [handle] = self._submit([(args, dict(kwargs))], wait_s=SUBMIT_WAIT_S)
        try:
            return handle.result()
        except KeyboardInterrupt:
            _cancel_all([handle])
            raise

    def map(
        self, *iterables: Iterable[Any], return_exceptions: bool = False, timeout: float | None = None
    ) -> Iterator[R | BaseException]:
        """Call on every item (several iterables: zipped into positional arguments), all submitted at
        once; results come in the inputs' order. A failing item raises when reached, or is yielded
        as the exception with `return_exceptions=True`. `timeout` bounds the whole map."""
        handles = self._submit([(tuple(a), {}) for a in zip(*iterables, strict=False)])
        if self.spec.gang:
            from computepool.sdk import gang  # noqa: PLC0415 - gang.py builds on this module

            return gang.ordered(handles, return_exceptions, timeout)
        return _ordered(self, handles, return_exceptions, timeout)

    def _submit(
        self, calls: list[tuple[tuple[Any, ...], dict[str, Any]]], wait_s: float = 0.0
    ) -> list[Handle[R]]:
        """Submit, BATCH calls a request; with `wait_s` (one batch), the answer waits that long for
        the calls' news (ended, or printed), which the handles take at once."""
        if self.spec.gang:
            from computepool.sdk import gang  # noqa: PLC0415 - gang.py builds on this module

            return [gang.start(self, a, k) for a, k in calls]
        fid = self.register()
        out: list[Handle[R]] = []
        for start in range(0, len(calls), BATCH):
            chunk = calls[start : start + BATCH]
            body: dict[str, Any] = {
                "calls": [{"args": base64.b64encode(pack_call(a, k)).decode()} for a, k in chunk],
                "key": uuid.uuid4().hex,
            }
            if wait_s > 0 and len(calls) <= BATCH:
                body["wait_s"] = wait_s
            try:
                answer = self._post_calls(fid, body)
                handles = [Handle(self, int(i)) for i in answer["ids"]]
                by_id = {h.id: h for h in handles}
                for c in answer.get("calls") or ():
                    h = by_id.get(int(c["id"]))
                    if h is not None:
                        h.take(c)
            except KeyboardInterrupt:  # Ctrl-C with the submission under way: cancel what it stored
                _cancel_all(out + self._stored(fid, body))
                raise
            out += handles
        return out

    def _stored(self, fid: int, body: dict[str, Any]) -> list[Handle[R]]:
        """The calls a submission stored, found by its key (sent again: stored once, if not before)."""
        with contextlib.suppress(Exception):
            again = {"calls": body["calls"], "key": body["key"]}
            ids = self.pool.client.request("POST", f"/functions/{fid}/calls", json=again)["ids"]
            return [Handle(self, int(i)) for i in ids]
        return []

    def _post_calls(self, fid: int, body: dict[str, Any]) -> Any:
        """POST the submission, sent again through an outage: its key makes that store it once."""
        path = f"/functions/{fid}/calls"
        try:
            return self.pool.rider.call(lambda: self.pool.client.request("POST", path, json=body))
        except PoolError as e:
            if e.status != 422 or e.field not in ("key", "wait_s"):
                raise
        # a control plane older than this client refused the new fields: nothing was stored
        return self.pool.client.request("POST", path, json={"calls": body["calls"]})

    def poll(self, handles: Sequence[Handle[Any]], wait_s: float, window: int = BATCH) -> None:
        """One long-poll for these calls (the first `window` not ended): printed output goes out
        here, ended calls are settled."""
        open_ = [h for h in handles if not h.ended][: min(window, BATCH)]
        if not open_:
            return
        body = {
            "ids": [h.id for h in open_],
            "wait_s": round(max(0.0, min(wait_s, 60.0)), 3),
            "output_from": {str(h.id): h.offset for h in open_},
            "stderr_from": {str(h.id): h.err_offset for h in open_ if h.err_offset},
        }
        fid = self.register()
        answer = self.pool.rider.call(
            lambda: self.pool.client.request("POST", f"/functions/{fid}/results", json=body)
        )
        by_id = {h.id: h for h in open_}
        for c in answer["calls"]:
            h = by_id.get(int(c["id"]))
            if h is not None:
                h.take(c)

    def delete(self) -> None:
        """Unregister the function; its workers are cancelled."""
        if self.function_id is not None:
            self.pool.client.request("DELETE", f"/functions/{self.function_id}")
            self.function_id = None


_DYNAMIC_FRAME = re.compile(r'^(\s*)File "<dynamic-code>", line (\d+), in (.+)$')


def localise(tb: str, fn: Callable[..., Any]) -> str:
    """Code that went by value shows as "<dynamic-code>" in the remote traceback; its line numbers
    are the caller's own, in the function's file: name that file and show its lines again."""
    code = getattr(fn, "__code__", None)
    path = code.co_filename if code is not None else ""
    if not tb or not path or (path.startswith("<") and path not in linecache.cache):
        return tb
    out: list[str] = []
    for line in tb.splitlines():
        m = _DYNAMIC_FRAME.match(line)
        if m is None:
            out.append(line)
            continue
        indent, number, name = m.groups()
        out.append(f'{indent}File "{path}", line {number}, in {name}')
        source = linecache.getline(path, int(number)).strip()
        if source:
            out.append(f"{indent}  {source}")
    return "\n".join(out) + ("\n" if tb.endswith("\n") else "")


def _ordered(
    fn: RemoteFunction[Any, Any], handles: list[Handle[Any]], return_exceptions: bool, timeout: float | None
) -> Iterator[Any]:
    deadline = None if timeout is None else time.monotonic() + timeout
    last = 0.0
    for i, h in enumerate(handles):
        try:
            while not h.ended:
                left = POLL_S if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"map: call {i} (of {len(handles)}) did not end within {timeout:g} s")
                time.sleep(max(0.0, min(last + MAP_POLL_GAP_S - time.monotonic(), left)))
                last = time.monotonic()
                fn.poll(handles[i:], min(left, POLL_S), WINDOW)
        except KeyboardInterrupt:  # Ctrl-C stops the map's work on the pool too
            _cancel_all(handles[i:])
            raise
        try:
            yield h.result(timeout=0)
        except Exception as e:
            if not return_exceptions:
                raise
            yield e


def _cancel_all(handles: Sequence[Handle[Any]]) -> None:
    """Cancel the calls not ended, as far as the pool answers (on the way out of an interrupt)."""
    for h in handles:
        if not h.ended:
            with contextlib.suppress(Exception):
                h.cancel()


class Handle(Generic[R]):
    """One call on the pool: `.result(timeout=)`, `.cancel()`."""

    def __init__(self, fn: RemoteFunction[Any, R], call_id: int) -> None:
        self.fn = fn
        self.id = call_id
        self.offset = 0  # characters of its stdout already printed here
        self.err_offset = 0  # and of its stderr
        self.state = "pending"
        self.outcome: dict[str, Any] | None = None

    @property
    def ended(self) -> bool:
        return self.outcome is not None

    def take(self, c: dict[str, Any]) -> None:
        """A results answer for this call: print what it printed since (its stdout on ours, its
        stderr on ours), keep the outcome if ended."""
        text, err = c.get("output") or "", c.get("stderr") or ""
        if text:
            sys.stdout.write(text)
            sys.stdout.flush()
        if err:
            sys.stderr.write(err)
            sys.stderr.flush()
        self.offset = int(c.get("output_next", self.offset + len(text)))
        self.err_offset = int(c.get("stderr_next", self.err_offset + len(err)))
        self.state = str(c["state"])
        if self.state in ENDED:
            self.outcome = c

    def result(self, timeout: float | None = None) -> R:
        """The value, once the call ends (TimeoutError after `timeout` s); the remote exception is
        raised as itself, with the remote traceback as its cause."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.outcome is None:
            left = POLL_S if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"call {self.id} of {self.fn.name} did not end within {timeout:g} s")
            self.fn.poll([self], min(left, POLL_S))
        return self._settle(self.outcome)

    def _settle(self, c: dict[str, Any]) -> R:
        state, ok = c["state"], c.get("ok")
        if state == "cancelled":
            raise CallCancelled(c.get("error") or f"call {self.id} was cancelled")
        if ok is None or c.get("result") is None:
            raise RemoteError(c.get("error") or f"call {self.id} ended {state} without a result")
        try:
            value = cloudpickle.loads(base64.b64decode(c["result"]))
        except Exception as e:  # noqa: BLE001 - e.g. a class this caller cannot import
            what = "result" if ok else "exception"
            detail = f"\n{c['traceback']}" if c.get("traceback") else ""
            raise RemoteError(f"call {self.id}: its {what} could not be read here ({e}){detail}") from None
        if ok:
            return value
        if not isinstance(value, BaseException):
            raise RemoteError(f"call {self.id} failed with a non-exception: {value!r}")
        tb = localise(c.get("traceback") or "", self.fn.fn)
        if tb and not getattr(value, "_cpool_noted", False):
            value.add_note(f"(raised on the pool, in call {self.id} of {self.fn.name})")
            value._cpool_noted = True  # type: ignore[attr-defined]
        raise value from RemoteTraceback(tb) if tb else None

    def cancel(self) -> None:
        """Cancel the call (a running one: its worker is ended); a call that ended is left as it is."""
        if self.ended:
            return
        fid = self.fn.register()
        self.fn.pool.client.request("DELETE", f"/functions/{fid}/calls/{self.id}")

    def __repr__(self) -> str:
        return f"<Handle call {self.id} of {self.fn.name}: {self.state}>"
