"""The remote side of a pool function: claims calls from the control plane, runs them, sends results.

It runs with the node's Python, not the caller's environment, so it uses the standard library and
cloudpickle alone (cloudpickle ships beside it, in `__cpool__/lib`). The SDK ships it in the code
archive as `__cpool__/worker.py`; the agent unpacks that into the job's work dir and starts
`python3.X -u __cpool__/worker.py` there, as the tenant's user, with:

- CPOOL_SERVER (one URL or several, comma-separated), CPOOL_WORKER_TOKEN (and CPOOL_CA): how to reach
  `POST /worker/next` and `/worker/output`;
- CPOOL_KEEP_WARM_S: how long to wait for another call once idle (0: one call, then exit);
- CPOOL_PIP (JSON list): requirements; built once per node into $CPOOL_CACHE_DIR/envs/<hash>;
- CPOOL_SYS_PATH (JSON list): the caller's import roots, relative to the work dir.

With `--once` it is one member of a gang call instead (see sdk/gang.py): it needs no control plane;
it reads the call's pickled (args, kwargs) from stdin, runs the function with the job's own stdout
and stderr (the allocation's logs) and the gang's environment, and writes the outcome to
`__cpool__/outcome.json`. It exits 0 when the function returned, 1 when it raised: a failed member
fails the gang, so members left waiting for it in a collective are stopped rather than hang.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import http.client
import json
import os
import shutil
import ssl
import subprocess
import sys
import threading
import time
import traceback
import urllib.parse
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FUNCTION_FILE = os.path.join(HERE, "function.pkl")
OUTCOME_FILE = os.path.join(HERE, "outcome.json")
FIRST_CALL_WAIT_S = 60.0  # a worker is started for a waiting call: it should come at once
LONG_POLL_S = 20.0
MAX_CLAIM = 32  # calls a warm worker claims at once (the control plane gives it its share of those waiting)
HAND_IN_S = 0.02  # a result waits at most this long for the rest of its batch before going back
HAND_IN_CHARS = 8 << 20  # results of one batch go back before they add up to more than this
FLUSH_EVERY_S = 0.2
PIP_TAIL_LINES = 15


def trace(what: str) -> None:
    """With CPOOL_WORKER_TRACE set, when each step happened (wall clock), on the job's stderr."""
    if os.environ.get("CPOOL_WORKER_TRACE"):
        print(f"cpool worker {time.time():.3f} {what}", file=sys.stderr, flush=True)


class Refused(Exception):
    """The control plane no longer accepts this worker's token (its allocation ended)."""

    def __init__(self, message: str, status: int = 0, missing_route: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.missing_route = missing_route  # the route itself: a control plane older than this worker


class Rejected(Exception):
    """The control plane refused the body itself (a result over its cap, say): no use sending it again."""


class Api:
    """JSON over one kept-alive HTTP(S) connection to the control plane, with the worker's token.

    CPOOL_SERVER may name several replicas, comma-separated (the agent passes every one it knows):
    a connection that fails, or a replica that answers 502/503/504, moves the worker to the next.
    """

    def __init__(self) -> None:
        self.urls = [u.strip() for u in os.environ["CPOOL_SERVER"].split(",") if u.strip()]
        if not self.urls:
            raise RuntimeError("CPOOL_SERVER names no control plane URL")
        self.headers = {
            "Authorization": "Bearer " + os.environ["CPOOL_WORKER_TOKEN"],
            "Content-Type": "application/json",
        }
        self.ca = os.environ.get("CPOOL_CA") or None
        self.conn: http.client.HTTPConnection | None = None
        self.at = 0
        self._aim(0)

    def _aim(self, index: int) -> None:
        """Talk to replica `index` of `urls` from the next connection on."""
        self.at = index % len(self.urls)
        url = urllib.parse.urlsplit(self.urls[self.at])
        self.https = url.scheme == "https"
        self.host = url.hostname or "127.0.0.1"
        self.port = url.port or (443 if self.https else 80)
        self.base = url.path.rstrip("/") + "/api/v1"
        self.context = ssl.create_default_context(cafile=self.ca) if self.https else None

    def _next(self) -> None:
        self.close()
        if len(self.urls) > 1:
            self._aim(self.at + 1)

    def _connect(self, timeout: float) -> http.client.HTTPConnection:
        if self.conn is None:
            if self.https:
                self.conn = http.client.HTTPSConnection(self.host, self.port, context=self.context)
            else:
                self.conn = http.client.HTTPConnection(self.host, self.port)
        self.conn.timeout = timeout
        if self.conn.sock is not None:
            self.conn.sock.settimeout(timeout)
        return self.conn

    def post(self, path: str, body: dict, timeout: float = 30.0, tries: int = 5) -> dict:
        data = json.dumps(body).encode()
        tries = max(tries, 2 * len(self.urls))  # each replica at least twice
        for attempt in range(tries):
            try:
                conn = self._connect(timeout)
                conn.request("POST", self.base + path, body=data, headers=self.headers)
                r = conn.getresponse()
                text = r.read()
            except (OSError, http.client.HTTPException):
                self._next()
                if attempt + 1 == tries:
                    raise
                time.sleep(min(0.2 * 2**attempt, 3.0))
                continue
            if 200 <= r.status < 300:
                return json.loads(text) if text else {}
            if r.status in (401, 403, 404, 410):
                missing = r.status == 404 and b"Not Found" in text[:100]
                raise Refused(f"{path}: HTTP {r.status} {text[:300]!r}", r.status, missing)
            if r.status in (400, 413, 422):
                raise Rejected(f"HTTP {r.status}: {text[:500].decode(errors='replace')}")
            if attempt + 1 == tries:
                raise RuntimeError(f"{path}: HTTP {r.status} {text[:300]!r}")
            if r.status in (502, 503, 504):  # this replica cannot serve now: another may
                self._next()
            time.sleep(min(0.2 * 2**attempt, 3.0))
        raise RuntimeError("unreachable")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


class Output:
    """What the running call prints, sent to the control plane every FLUSH_EVERY_S and at its end;
    stdout and stderr apart, each in its order, so the caller can write each to its own stream."""

    def __init__(self) -> None:
        self.api: Api | None = None
        self.call: int | None = None
        self.parts: list[tuple[str, str]] = []  # (stream, text), in the order written
        self.lock = threading.Lock()
        self.send_lock = threading.Lock()
        self.wake = threading.Event()
        threading.Thread(target=self._run, name="cpool-output", daemon=True).start()

    def add(self, text: str, stream: str = "stdout") -> None:
        with self.lock:
            if self.call is not None:
                self.parts.append((stream, text))

    def begin(self, call_id: int) -> None:
        with self.lock:
            self.call, self.parts = call_id, []

    def end(self) -> None:
        self.flush()
        with self.lock:
            self.call = None

    def flush(self) -> None:
        with self.send_lock:
            with self.lock:
                call, parts, self.parts = self.call, self.parts, []
            if call is None or not parts:
                return
            if self.api is None:
                self.api = Api()
            for stream in ("stdout", "stderr"):
                data = "".join(text for s, text in parts if s == stream)
                if not data:
                    continue
                # output is best effort: the call's result matters more
                with contextlib.suppress(
                    OSError, RuntimeError, Refused, Rejected, http.client.HTTPException, ValueError
                ):
                    self.api.post("/worker/output", {"id": call, "data": data, "stream": stream}, tries=3)

    def _run(self) -> None:
        while True:
            time.sleep(FLUSH_EVERY_S)
            if self.parts:
                self.flush()


class Stream:
    """sys.stdout / sys.stderr while a call runs: text goes to the call's output, and to the job's log."""

    def __init__(self, output: Output, original: object, name: str) -> None:
        self.output = output
        self.original = original
        self.name = name  # "stdout" or "stderr": the call's stream it feeds
        self.encoding = getattr(original, "encoding", "utf-8")
        self.errors = getattr(original, "errors", "strict")

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        self.output.add(text, self.name)
        return len(text)

    def writelines(self, lines: object) -> None:
        for line in lines:  # type: ignore[attr-defined]
            self.write(line)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return int(self.original.fileno())  # type: ignore[attr-defined]


def setup_sys_path() -> None:
    """The caller's import roots first (relative to the work dir), then the shipped cloudpickle."""
    while HERE in sys.path:
        sys.path.remove(HERE)
    roots = json.loads(os.environ.get("CPOOL_SYS_PATH") or '["."]')
    for rel in reversed(roots):
        sys.path.insert(0, os.path.normpath(os.path.join(ROOT, rel)))
    sys.path.append(os.path.join(HERE, "lib"))


def env_dir(requirements: list[str]) -> str:
    """Where the environment of these requirements lives: one per requirement set and interpreter."""
    cache = os.environ.get("CPOOL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "cpool")
    # the interpreter too (its full version and where it lives): an image's Python is another one
    key = json.dumps([sorted(requirements), sys.version, os.path.realpath(sys.executable)])
    return os.path.join(cache, "envs", hashlib.sha256(key.encode()).hexdigest()[:32])


def build_env(requirements: list[str]) -> str:
    """The environment's directory, built now unless it is there: under a lock, so workers of the
    node build it once; into a temporary dir renamed when complete, so a half build is never used.
    Raises RuntimeError with pip's last lines when the build fails."""
    final = env_dir(requirements)
    if os.path.isdir(final):
        return final
    os.makedirs(os.path.dirname(final), mode=0o700, exist_ok=True)
    with open(final + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isdir(final):
            return final
        tmp = final + ".building"
        shutil.rmtree(tmp, ignore_errors=True)
        steps = [
            [sys.executable, "-m", "venv", tmp],
            [os.path.join(tmp, "bin", "python"), "-m", "pip", "install", "--disable-pip-version-check",
             "--no-input", *requirements],
        ]  # fmt: skip
        for argv in steps:
            done = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
            if done.returncode != 0:
                shutil.rmtree(tmp, ignore_errors=True)
                tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-PIP_TAIL_LINES:])
                what = "pip install " + " ".join(requirements) if "pip" in argv else "python -m venv"
                raise RuntimeError(f"{what} failed on this node (exit {done.returncode}):\n{tail}")
        os.rename(tmp, final)
    return final


def bootstrap() -> str | None:
    """Re-exec in the requirements' environment when CPOOL_PIP asks for one; else why it can't be had."""
    requirements = json.loads(os.environ.get("CPOOL_PIP") or "[]")
    if not requirements:
        return None
    try:
        final = build_env(requirements)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return str(e)
    if os.path.realpath(sys.prefix) != os.path.realpath(final):
        python = os.path.join(final, "bin", "python")
        sys.stdout.flush()
        os.execv(python, [python, "-u", os.path.abspath(__file__), *sys.argv[1:]])
    return None


def dump(value: object, ok: bool, tb: str | None) -> tuple[bool, str, str | None]:
    """The pickled value (ok) or exception; what cannot be pickled becomes an error naming its type."""
    import cloudpickle

    try:
        return ok, base64.b64encode(cloudpickle.dumps(value)).decode(), tb
    except Exception as e:  # noqa: BLE001 - any pickling failure is reported, not raised
        kind = type(value).__module__ + "." + type(value).__qualname__
        if ok:
            err: Exception = TypeError(f"the function's result, of type {kind}, could not be pickled: {e}")
        else:
            err = RuntimeError(f"{kind}: {value} (the exception could not be pickled: {e})")
        return False, base64.b64encode(cloudpickle.dumps(err)).decode(), tb


class Runner:
    """Holds the function (unpickled at the first call) and runs calls with their output captured."""

    def __init__(self, output: Output, broken: str | None) -> None:
        self.output = output
        self.broken = broken
        self.fn: Any = None

    def run(self, call: dict) -> dict:
        import cloudpickle

        cid = call["id"]
        self.output.begin(cid)
        saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = (
            Stream(self.output, saved[0], "stdout"),
            Stream(self.output, saved[1], "stderr"),
        )
        tb = None
        try:
            if self.broken:
                raise RuntimeError(self.broken)
            if self.fn is None:
                with open(FUNCTION_FILE, "rb") as f:
                    self.fn = cloudpickle.load(f)
            args, kwargs = cloudpickle.loads(base64.b64decode(call["args"]))
            value, ok = self.fn(*args, **kwargs), True
        except (Exception, SystemExit) as e:  # the caller's exception: it goes back to the caller
            value, ok, tb = e, False, traceback.format_exc()
        finally:
            sys.stdout, sys.stderr = saved
            self.output.end()
        ok, result, tb = dump(value, ok, tb)
        return {"id": cid, "ok": ok, "result": result, "traceback": tb}


class Exchange:
    """Results in, calls out: `POST /worker/calls` (many of each), or `/worker/next` (one) with a
    control plane that has no such route yet."""

    def __init__(self, api: Api) -> None:
        self.api = api
        self.legacy = False

    def __call__(self, done: list, max_calls: int, wait: float, holding: list | None = None) -> dict:
        """{"calls": [...], "stop": bool}; a result the control plane refuses (over its cap, say)
        goes back as an error naming why, the others as they are."""
        try:
            return self._post(done, max_calls, wait, holding or [])
        except Rejected as e:
            if not done or (len(done) == 1 and not done[0].get("result")):
                raise
            if len(done) > 1:  # find the one refused: each alone
                for d in done:
                    self([d], 0, 0.0)
                return self([], max_calls, wait)
            why = RuntimeError(f"the call's outcome could not be handed to the control plane: {e}")
            ok, result, tb = dump(why, False, done[0].get("traceback"))
            return self([{"id": done[0]["id"], "ok": ok, "result": result, "traceback": tb}], max_calls, wait)

    def _post(self, done: list, max_calls: int, wait: float, holding: list) -> dict:
        if not self.legacy:
            body = {"done": done, "max_calls": max_calls, "wait_s": round(wait, 3), "holding": holding}
            try:
                return self.api.post("/worker/calls", body, timeout=wait + 30)
            except Refused as e:
                if not e.missing_route:
                    raise
                self.legacy = True
        calls: list = []
        for i, d in enumerate(done or [None]):
            last = i == max(len(done), 1) - 1
            one = {"done": d, "wait_s": round(wait, 3) if last and max_calls else 0}
            answer = self.api.post("/worker/next", one, timeout=wait + 30)
            if answer.get("stop"):
                return {"calls": [], "stop": True}
            if answer.get("call"):
                calls.append(answer["call"])
        return {"calls": calls, "stop": False}


def serve(api: Api, runner: Runner, keep_warm_s: float) -> int:
    """Claim, run, report until idle for `keep_warm_s` (0: after one call) or told to stop.

    A warm worker claims up to MAX_CLAIM calls at once (its share of those waiting) and runs them
    in order; their results go back together when the batch is done, or once the first of them
    has waited HAND_IN_S, so a long call's result is not held back by the ones after it; the
    answer to such a hand-in names the calls of the batch cancelled meanwhile, which it drops."""
    exchange = Exchange(api)
    max_calls = MAX_CLAIM if keep_warm_s > 0 else 1
    done: list = []  # results not handed in yet
    queue: list = []  # calls claimed, not run yet
    served, stopping = 0, False
    started = time.monotonic()
    last = started
    first_done = 0.0
    while True:
        if queue:
            call = queue.pop(0)
            if not done:
                first_done = time.monotonic()
            done.append(runner.run(call))
            served += 1
            last = time.monotonic()
            size = sum(len(d.get("result") or "") + len(d.get("traceback") or "") for d in done)
            if queue and last - first_done < HAND_IN_S and size < HAND_IN_CHARS:
                continue
            if queue:  # hand these in now, claim nothing: the batch is not over
                trace("results in")
                answer = exchange(done, 0, 0.0, [c["id"] for c in queue])
                dropped = set(answer.get("drop") or ())  # cancelled meanwhile: not run
                queue = [c for c in queue if c["id"] not in dropped] + list(answer.get("calls") or [])
                done = []
                continue
        now = time.monotonic()
        if stopping or (served and keep_warm_s <= 0):
            left = 0.0
        elif served == 0:
            left = started + max(keep_warm_s, FIRST_CALL_WAIT_S) - now
        else:
            left = last + keep_warm_s - now
        if left <= 0 and not done:
            return served
        wait = max(0.0, min(left, LONG_POLL_S))
        trace("next" + (f" ({len(done)} result(s) in)" if done else ""))
        answer = exchange(done, 0 if stopping else max_calls, wait)
        done = []
        queue = list(answer.get("calls") or [])
        trace(f"claimed {len(queue)}" if queue else "no call")
        stopping = stopping or bool(answer.get("stop"))


def once(broken: str | None) -> int:
    """Run the call on stdin here, as one member of a gang; its outcome goes to OUTCOME_FILE."""
    import cloudpickle

    tb = None
    try:
        if broken:
            raise RuntimeError(broken)
        with open(FUNCTION_FILE, "rb") as f:
            fn = cloudpickle.load(f)
        args, kwargs = cloudpickle.loads(sys.stdin.buffer.read())
        value, ok = fn(*args, **kwargs), True
    except (Exception, SystemExit) as e:  # the caller's exception: it goes back to the caller
        value, ok, tb = e, False, traceback.format_exc()
    ok, result, tb = dump(value, ok, tb)
    rank = os.environ.get("CPOOL_RANK") or "0"
    with open(OUTCOME_FILE + ".tmp", "w") as f:
        json.dump({"rank": int(rank), "ok": ok, "result": result, "traceback": tb}, f)
    os.replace(OUTCOME_FILE + ".tmp", OUTCOME_FILE)  # never read half written
    sys.stdout.flush()
    sys.stderr.flush()
    return 0 if ok else 1


def main() -> int:
    trace("started")
    setup_sys_path()
    broken = bootstrap()
    if broken:
        print(broken, file=sys.stderr, flush=True)
    if sys.argv[1:] == ["--once"]:
        return once(broken)
    api = Api()
    runner = Runner(Output(), broken)
    try:
        served = serve(api, runner, float(os.environ.get("CPOOL_KEEP_WARM_S") or 0))
    except Refused as e:
        print(f"cpool worker: the control plane ended this worker ({e})", file=sys.stderr, flush=True)
        return 0
    finally:
        api.close()
    print(f"cpool worker: served {served} call(s); exiting", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
