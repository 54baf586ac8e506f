"""Real `cpool gateway` processes beside the control plane: streaming passed through as it comes,
the queue when every replica is busy or none is there yet, retries, and several gateways at once."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import Api
from gateway_kit import Registry, cpool_cmd, engine, gateway_process, wait_until
from harness import free_port

H = dict[str, str]


@pytest.fixture
def setup(api: Api, db_url: str, tmp_path: Path) -> Iterator[tuple[Api, Registry, H, str]]:
    """The control plane (in process), tenant t1 with member alice, and one gateway process."""
    api.tenant("t1")
    alice = api.user("alice", "t1", "member")
    with gateway_process(db_url, tmp_path / "gateway.log") as base:
        yield api, Registry(api.app.state.db), alice, base


def usage_of(api: Api, service: str, requests: int) -> dict[str, Any]:
    """The service's usage summed over rows, once `requests` requests are counted."""

    def summed() -> dict[str, Any] | None:
        items = api.ok("GET", "/api/v1/gateway/usage", params={"service": service})["items"]
        total = {
            k: sum(i[k] for i in items) for k in ("requests", "failed", "prompt_tokens", "completion_tokens")
        }
        return total if total["requests"] == requests else None

    return dict(wait_until(summed, 15, f"usage of {service}"))


@pytest.mark.parametrize("backend", ["sqlite"])
def test_stream_chunks_pass_through_as_they_come(setup: tuple[Api, Registry, H, str]) -> None:
    api, reg, alice, base = setup
    with engine(ms_per_token=150) as port:
        reg.replica(reg.service("t1", "streamer"), port)
        body = {"model": "streamer", "messages": [{"role": "user", "content": "tell me"}], "max_tokens": 6}
        whole = httpx.post(f"{base}/v1/chat/completions", json=body, headers=alice, timeout=30)
        assert whole.status_code == 200, whole.text
        text = whole.json()["choices"][0]["message"]["content"]
        prompt_tokens = whole.json()["usage"]["prompt_tokens"]

        arrived: list[tuple[float, str]] = []
        stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream(
            "POST", f"{base}/v1/chat/completions", json=stream_body, headers=alice, timeout=30
        ) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if line.startswith("data:"):
                    arrived.append((time.monotonic(), line[5:].strip()))
        assert arrived[-1][1] == "[DONE]"
        chunks = [json.loads(p) for _, p in arrived[:-1]]
        pieces = [c["choices"][0]["delta"]["content"] for c in chunks if c["choices"]]
        assert "".join(pieces) == text and len(pieces) == 6  # all of them, in order
        # each came as the engine made it (150 ms apart), not all at once at the end
        content_times = [t for (t, _), c in zip(arrived, chunks, strict=False) if c["choices"]]
        assert content_times[-1] - content_times[0] >= 0.5, content_times
        assert chunks[-1]["usage"]["completion_tokens"] == 6

        # a stream without usage: its chunks with text count as completion tokens
        with httpx.stream(
            "POST",
            f"{base}/v1/completions",
            headers=alice,
            timeout=30,
            json={"model": "streamer", "prompt": "go", "max_tokens": 4, "stream": True},
        ) as r:
            got = [line for line in r.iter_lines() if line.startswith("data:")]  # fmt: skip
        assert len(got) == 5  # four chunks and [DONE]
        total = usage_of(api, "streamer", 3)
        assert total["prompt_tokens"] == 2 * prompt_tokens  # the whole answer's and the stream's usage
        assert total["completion_tokens"] == 6 + 6 + 4 and total["failed"] == 0

        # a caller that goes away mid-stream frees its place on the replica
        sid = next(iter({row.service_id for row in reg.loads_by_name("streamer")}))
        long_body = {"model": "streamer", "prompt": "go", "max_tokens": 200, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=long_body, headers=alice, timeout=30) as r:
            lines = r.iter_lines()  # kept open (a dropped iterator would close the connection)
            assert next(lines).startswith("data:")
            wait_until(lambda: any(row.inflight == 1 for row in reg.loads(sid)), 10, "the stream in flight")
        wait_until(lambda: all(row.inflight == 0 for row in reg.loads(sid)), 10, "the stream's place freed")


@pytest.mark.parametrize("backend", ["sqlite"])
def test_busy_replicas_queue_and_least_loaded_wins(setup: tuple[Api, Registry, H, str]) -> None:
    api, reg, alice, base = setup
    with (
        engine(model="r1", slots=1, ms_per_token=100) as p1,
        engine(model="r2", slots=1, ms_per_token=100) as p2,
    ):
        sid = reg.service("t1", "busy", max_inflight=1, target_inflight=1)
        reg.replica(sid, p1)
        reg.replica(sid, p2)

        def ask(tokens: int = 8) -> tuple[int, str, float]:
            t0 = time.monotonic()
            r = httpx.post(f"{base}/v1/completions", headers=alice, timeout=60,
                           json={"model": "busy", "prompt": "q", "max_tokens": tokens})  # fmt: skip
            return r.status_code, r.json().get("model", r.text), time.monotonic() - t0

        # one at a time: equally idle replicas take turns
        assert [ask(1)[1] for _ in range(4)] == ["r1", "r2", "r1", "r2"]

        queued_seen = threading.Event()

        def watch() -> None:
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and not queued_seen.is_set():
                if any(row.queued >= 1 for row in reg.loads(sid)):
                    queued_seen.set()
                time.sleep(0.05)

        watcher = threading.Thread(target=watch)
        watcher.start()
        with ThreadPoolExecutor(3) as pool:
            results = list(pool.map(lambda _: ask(8), range(3)))
        watcher.join()
        assert [r[0] for r in results] == [200, 200, 200]
        assert {r[1] for r in results} == {"r1", "r2"}  # one request per replica at a time …
        assert max(r[2] for r in results) >= 1.4  # … so the third waited for one to finish
        assert queued_seen.is_set(), "the load report never showed the waiting request"


@pytest.mark.parametrize("backend", ["sqlite"])
def test_queue_timeout_and_wake_from_zero(setup: tuple[Api, Registry, H, str]) -> None:
    api, reg, alice, base = setup
    reg.service("t1", "nobody", queue_timeout_s=1)
    t0 = time.monotonic()
    r = httpx.post(
        f"{base}/v1/completions", json={"model": "nobody", "prompt": "x"}, headers=alice, timeout=30
    )
    assert r.status_code == 503 and time.monotonic() - t0 >= 0.9
    assert r.json()["error"]["message"] == "no replica of service 'nobody' became free within 1 s"
    assert int(r.headers["Retry-After"]) >= 1
    assert usage_of(api, "nobody", 1)["failed"] == 1

    # at zero: the request waits, its gateway reports it queued; a replica that becomes ready serves it
    sid = reg.service("t1", "sleepy", queue_timeout_s=60)
    answer: list[httpx.Response] = []
    body = {"model": "sleepy", "prompt": "x"}
    waiter = threading.Thread(
        target=lambda: answer.append(
            httpx.post(f"{base}/v1/completions", json=body, headers=alice, timeout=60)
        )
    )
    waiter.start()
    wait_until(lambda: any(row.queued == 1 for row in reg.loads(sid)), 10, "the queued request's report")
    assert not answer
    with engine(model="woken") as port:
        reg.replica(sid, port)
        waiter.join(20)
        assert answer and answer[0].status_code == 200 and answer[0].json()["model"] == "woken"


@pytest.mark.parametrize("backend", ["sqlite"])
def test_unreachable_replica_is_skipped(setup: tuple[Api, Registry, H, str], tmp_path: Path) -> None:
    api, reg, alice, base = setup
    with engine(model="alive") as port:
        sid = reg.service("t1", "flaky")
        dead = reg.replica(sid, free_port())  # nothing listens there; the first request is sent to it
        reg.replica(sid, port)
        for _ in range(4):
            r = httpx.post(
                f"{base}/v1/completions", json={"model": "flaky", "prompt": "x"}, headers=alice, timeout=30
            )
            assert r.status_code == 200 and r.json()["model"] == "alive", r.text
        assert usage_of(api, "flaky", 4)["failed"] == 0
        assert (
            f"replica {dead} of flaky unreachable (ConnectError); trying another"
            in (tmp_path / "gateway.log").read_text()
        )


@pytest.mark.parametrize("backend", ["sqlite"])
def test_large_bodies_are_refused_chunked_ones_too(setup: tuple[Api, Registry, H, str]) -> None:
    api, reg, alice, base = setup
    headers = {**alice, "content-type": "application/json"}

    def chunks() -> Iterator[bytes]:  # no Content-Length: sent chunked
        for _ in range(20):
            yield b" " * 65536

    for content in (chunks(), b" " * ((1 << 20) + 1)):
        r = httpx.post(f"{base}/v1/completions", content=content, headers=headers, timeout=30)
        assert r.status_code == 413, r.text
        err = r.json()["error"]
        assert err["code"] == "request_too_large" and err["message"] == "body: larger than 1048576 bytes"
    # the control plane's own limit (--max-body-bytes, the same 1 MiB by default) answers first there
    big = api.post("/v1/completions", content=chunks(), headers=headers)
    assert big.status_code == 413 and "1048576" in big.text
    small = httpx.post(f"{base}/v1/completions", content=b" " * 1000 + b"{}", headers=headers, timeout=30)
    assert small.status_code == 400 and small.json()["error"]["message"].startswith("model:")


def test_two_gateways_both_route_and_report(
    setup: tuple[Api, Registry, H, str], db_url: str, tmp_path: Path
) -> None:
    api, reg, alice, base = setup
    with engine() as port, gateway_process(db_url, tmp_path / "gateway2.log") as base2:
        sid = reg.service("t1", "shared")
        reg.replica(sid, port)
        for i in range(6):
            url = (base, base2)[i % 2]
            r = httpx.post(
                f"{url}/v1/completions", json={"model": "shared", "prompt": "x y"}, headers=alice, timeout=30
            )
            assert r.status_code == 200, r.text
        models = httpx.get(f"{base2}/v1/models", headers=alice, timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["shared"]

        def reports() -> list[Any]:
            rows = [row for row in reg.loads(sid) if row.requests == 3]
            return rows if len(rows) == 2 else []

        rows = wait_until(reports, 10, "both gateways' load reports")
        assert len({row.gateway for row in rows}) == 2
        total = usage_of(api, "shared", 6)
        assert total["prompt_tokens"] == 6 * 2 and total["completion_tokens"] == 6 * 16


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--db", "mysql://x/y"],
            "error: --db: expected a sqlite:/// or postgresql+psycopg:// URL, got 'mysql://x/y'",
        ),
        (["--db", "sqlite:////nowhere/pool.db"], "error: --db: no database at '/nowhere/pool.db'"),
        (
            ["--db", "sqlite:////x.db", "--tls-cert", "/etc/hostname"],
            "error: --tls-cert and --tls-key go together",
        ),
        (["--db", "sqlite:////x.db", "--log-level", "loud"], "error: --log-level: unknown level 'loud'"),
    ],
)
def test_gateway_command_refuses_bad_options_in_one_line(args: list[str], message: str) -> None:
    r = subprocess.run(cpool_cmd("gateway", *args), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), r.stderr
