"""Several control-plane URLs: the CLI and `PoolClient` move past a replica that refuses the
connection or answers 503, stay with the one that answers, and never send a request that may
already have been carried out to a second replica (unless it carries an idempotency key)."""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from poolkit import Cli, PoolServer

from computepool.client import PoolClient, PoolError, ServerUnreachable
from computepool.client.aio import AioApi
from computepool.core.errors import InvalidInput
from computepool.core.servers import ServerList, split_servers
from computepool.core.tls import generate_self_signed
from computepool.wire.allocations import AllocationCreate


def _closed_url() -> str:
    """A loopback URL where nothing listens (the port is bound, never listened on, while in use)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    _closed.append(s)
    return f"http://127.0.0.1:{s.getsockname()[1]}"


_closed: list[socket.socket] = []


@contextmanager
def _busy_replica(retry_after: str = "30") -> Iterator[tuple[str, list[str]]]:
    """A replica that answers every request 503 with Retry-After; yields its URL and the paths asked."""
    seen: list[str] = []

    class Busy(BaseHTTPRequestHandler):
        def _busy(self) -> None:
            seen.append(self.path)
            self.send_response(503)
            self.send_header("Retry-After", retry_after)
            self.send_header("Content-Type", "application/json")
            body = b'{"error": "database unavailable"}'
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _busy  # noqa: N815 - the handler's names

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Busy)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", seen
    finally:
        httpd.shutdown()
        httpd.server_close()


@contextmanager
def _dropping_replica() -> Iterator[tuple[str, list[bytes]]]:
    """A replica that reads each request whole and closes the connection without an answer (it
    died after the request arrived); yields its URL and the requests' first lines."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(16)
    seen: list[bytes] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = lsock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                data = b""
                try:
                    while b"\r\n\r\n" not in data:
                        chunk = conn.recv(65536)
                        if not chunk:
                            break
                        data += chunk
                except OSError:
                    continue
                if data:
                    seen.append(data.split(b"\r\n", 1)[0])

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{lsock.getsockname()[1]}", seen
    finally:
        stop.set()
        lsock.close()


def test_split_servers_reads_commas_and_repeats() -> None:
    assert split_servers("http://a:1, https://b:2/") == ("http://a:1", "https://b:2")
    assert split_servers(["http://a:1", "http://b:2,http://a:1", "c:3"]) == (
        "http://a:1",
        "http://b:2",
        "http://c:3",
    )
    with pytest.raises(InvalidInput, match="ftp://x"):
        split_servers("http://a:1,ftp://x")


def test_learnt_replicas_keep_the_given_ones_and_never_downgrade() -> None:
    servers = ServerList(["https://a:1"])
    assert servers.learn(["https://b:2", "http://evil:3", "not a url at all"])
    assert servers.urls == ("https://a:1", "https://b:2")  # no http where https was given
    servers.failed("https://a:1")
    assert servers.current == "https://b:2"
    assert servers.learn(["https://c:3"])  # b is gone from the answer: forgotten, a never
    assert servers.urls == ("https://a:1", "https://c:3")
    assert not servers.learn(["https://c:3"])


def test_cli_moves_past_servers_that_refuse(cli: Cli, server: PoolServer) -> None:
    name = f"t{uuid.uuid4().hex[:8]}"
    dead, dead2 = _closed_url(), _closed_url()
    r = cli("tenants", "create", name, "--server", dead, "--server", server.url, "--server", dead2)
    assert r.exit_code == 0, r.stdout + r.stderr  # a refused connection: the POST never went out
    r = cli("tenants", "list", "--json", env={"CPOOL_SERVER": f"{dead},{server.url}"})
    assert r.exit_code == 0, r.stdout + r.stderr
    assert r.stdout.count(f'"{name}"') == 1


def test_cli_says_which_servers_it_tried(cli: Cli) -> None:
    dead, dead2 = _closed_url(), _closed_url()
    r = cli("tenants", "list", env={"CPOOL_SERVER": f"{dead},{dead2}"})
    assert r.exit_code == 1
    assert dead in r.stderr and dead2 in r.stderr and "Traceback" not in r.stderr


def test_a_503_moves_on_and_its_retry_after_is_kept(server: PoolServer) -> None:
    with _busy_replica() as (busy, seen):
        naps: list[float] = []
        with PoolClient([busy, server.url], server.token, sleep=naps.append) as pool:
            assert pool.whoami()["name"]
            assert pool.server == server.url  # it stays with the one that answered
            assert pool.list_tenants()
        assert len(seen) == 1  # asked once, then left alone for its Retry-After
        assert naps == []  # nobody waited: another replica answered at once


def test_a_lone_busy_server_is_waited_for_as_it_says(server: PoolServer) -> None:
    with _busy_replica(retry_after="1") as (busy, seen):
        naps: list[float] = []
        with (
            PoolClient(busy, server.token, retries=2, sleep=naps.append) as pool,
            pytest.raises(PoolError, match="database unavailable"),
        ):
            pool.whoami()
        assert len(seen) == 3 and naps and all(n > 0 for n in naps)


def test_a_post_that_may_have_arrived_goes_to_no_second_server(server: PoolServer) -> None:
    name = f"t{uuid.uuid4().hex[:8]}"
    with _dropping_replica() as (dropper, seen), PoolClient([dropper, server.url], server.token) as pool:
        with pytest.raises(ServerUnreachable):
            pool.create_tenant(name)
        assert [line.split()[0] for line in seen] == [b"POST"]
        with PoolClient(server.url, server.token) as other:
            assert name not in {t["name"] for t in other.list_tenants()}  # never sent twice
    # a submission carries an Idempotency-Key: sent again, to the replica that answers
    req = AllocationCreate(cpu_milli=100, memory_mib=64)
    with _dropping_replica() as (dropper, seen), PoolClient([dropper, server.url], server.token) as pool:
        alloc = pool.create_allocation(req, idempotency_key=name)
        assert seen and pool.server == server.url
        assert pool.create_allocation(req, idempotency_key=name)["id"] == alloc["id"]


def test_the_benchmarks_async_client_moves_on_too(server: PoolServer) -> None:
    async def whoami() -> tuple[str, str]:
        async with AioApi(f"{_closed_url()},{server.url}", server.token, 2, 10) as api:
            return (await api.call("GET", "/whoami"))["name"], api.server

    name, used = asyncio.run(whoami())
    assert name and used == server.url


def test_certificates_are_loaded_only_where_tls_is_spoken(tmp_path: Path) -> None:
    """Plain-http URLs alone: no CA bundle is read (it is ~100 ms of a short command's start-up);
    any https URL: the system's CAs, or the pool's CA alone when one is given."""
    with PoolClient("http://127.0.0.1:1,http://127.0.0.1:2") as plain:
        assert plain._verify(None) is False
    with PoolClient("http://127.0.0.1:1,https://127.0.0.1:2") as mixed:
        assert mixed._verify(None) is True
    generate_self_signed(tmp_path / "ca.pem", tmp_path / "key.pem", ["127.0.0.1"])
    with PoolClient("http://127.0.0.1:1") as pinned:
        assert isinstance(pinned._verify(str(tmp_path / "ca.pem")), ssl.SSLContext)
