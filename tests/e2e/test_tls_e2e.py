"""The pool over HTTPS: a real `cpool server --tls-cert/--tls-key`, the CLI, the SDK's clients and an
agent that pins the server's certificate from its join token.

The certificate is made here the way `cpool up` makes it. A client without the CA is refused with
one readable line; an agent whose join token pins another certificate does not join.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from e2e_helpers import Pool, child_env, cpool, free_port, stop, wait_for

from computepool.client import PoolClient, ServerUnreachable
from computepool.client.aio import AioApi
from computepool.core.tls import file_fingerprint, generate_self_signed, split_pin, with_pin


@dataclass
class Tls:
    url: str
    data: Path
    cert: Path
    pool: Pool
    tmp: Path

    def env(self, **extra: str) -> dict[str, str]:
        return {**child_env(), "CPOOL_SERVER": self.url, "CPOOL_CONFIG": str(self.tmp / "cfg.json"), **extra}

    def token(self) -> str:
        return (self.data / "admin-token").read_text().strip()


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tls]:
    tmp = tmp_path_factory.mktemp("tls")
    data, port = tmp / "srv", free_port()
    cert, key = tmp / "tls" / "cert.pem", tmp / "tls" / "key.pem"
    generate_self_signed(cert, key, ["localhost", "127.0.0.1"])
    url = f"https://127.0.0.1:{port}"
    log = tmp / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cpool("server", "--data-dir", str(data), "--port", str(port), "--tls-cert", str(cert),
                  "--tls-key", str(key)),
            stdout=out, stderr=subprocess.STDOUT, env=child_env(),
        )  # fmt: skip
    try:
        wait_for("the server", lambda: (data / "admin-token").exists() and Pool(url, data, cert).ready(), 30)
        pool = Pool(url, data, cert)
        yield Tls(url, data, cert, pool, tmp)
        pool.close()
    finally:
        stop(proc)


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cpool(*args), env=env, capture_output=True, text=True, timeout=60)


def test_key_is_private_and_plain_http_is_not_served(tls: Tls) -> None:
    assert (tls.cert.parent / "key.pem").stat().st_mode & 0o077 == 0
    plain = tls.url.replace("https://", "http://")
    r = _cli(tls.env(CPOOL_SERVER=plain, CPOOL_TOKEN=tls.token()), "tenants", "list")
    assert r.returncode == 1 and "Traceback" not in r.stderr


def test_cli_without_the_ca_is_refused_in_one_line_and_login_saves_it(tls: Tls) -> None:
    env = tls.env(CPOOL_TOKEN=tls.token())
    r = _cli(env, "tenants", "list")
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr
    assert "TLS certificate is not trusted" in lines[0] and "--ca" in lines[0]

    assert _cli({**env, "CPOOL_CA": str(tls.cert)}, "tenants", "list").returncode == 0
    assert _cli(env, "--ca", str(tls.cert), "tenants", "list").returncode == 0
    missing = _cli(env, "login", "--ca", str(tls.tmp / "nope.pem"))
    assert missing.returncode != 0 and "--ca" in missing.stderr and "Traceback" not in missing.stderr

    # `cpool login --ca` keeps the CA with the server: later commands need neither flag nor variable
    login = _cli(env, "login", "--ca", str(tls.cert))
    assert login.returncode == 0, login.stderr
    saved = json.loads((tls.tmp / "cfg.json").read_text())
    assert saved["server"] == tls.url and saved["ca"] == str(tls.cert)
    bare = {k: v for k, v in env.items() if k not in ("CPOOL_SERVER", "CPOOL_TOKEN")}
    r = _cli(bare, "tenants", "list", "--json")
    assert r.returncode == 0, r.stderr
    assert [t["name"] for t in json.loads(r.stdout)] == ["default"]


def test_sdk_clients_verify(tls: Tls) -> None:
    with PoolClient(tls.url, tls.token(), ca=str(tls.cert)) as pool:
        assert pool.whoami()["name"] == "admin"
    with PoolClient(tls.url, tls.token()) as pool, pytest.raises(ServerUnreachable, match="not trusted"):
        pool.whoami()

    async def aio(ca: str | None) -> object:
        async with AioApi(tls.url, tls.token(), 2, 10, ca=ca) as api:
            return await api.call("GET", "/whoami")

    assert asyncio.run(aio(str(tls.cert)))["name"] == "admin"  # type: ignore[index]
    with pytest.raises(ServerUnreachable, match="not trusted"):
        asyncio.run(aio(None))


def _agent(tls: Tls, name: str, token: str, *extra: str) -> tuple[subprocess.Popen[bytes], Path, Path]:
    agent_dir, log = tls.tmp / name, tls.tmp / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cpool("agent", "--server", tls.url, "--data-dir", str(agent_dir), "--simulate", "1xT4-16GB",
                  "--name", name, "--poll-wait-s", "3", *extra),
            stdout=out, stderr=subprocess.STDOUT, env={**child_env(), "CPOOL_JOIN_TOKEN": token},
        )  # fmt: skip
    return proc, agent_dir, log


def test_join_token_pins_the_certificate_and_the_agent_runs_jobs(tls: Tls) -> None:
    token = tls.pool.http.post("/api/v1/join-tokens", json={}).json()["token"]
    proper, pin = split_pin(token)
    assert pin == file_fingerprint(tls.cert) and proper.count(".") == 1

    # a token whose pin names another certificate: the agent refuses before sending anything
    other = tls.tmp / "other"
    generate_self_signed(other / "cert.pem", other / "key.pem", ["127.0.0.1"])
    forged = with_pin(proper, file_fingerprint(other / "cert.pem"))
    proc, bad_dir, bad_log = _agent(tls, "pinned-wrong", forged)
    assert proc.wait(timeout=60) != 0
    text = bad_log.read_text()
    assert "the join token pins" in text and "Traceback" not in text
    assert not (bad_dir / "node.json").exists() and not (bad_dir / "server-ca.pem").exists()
    assert "pinned-wrong" not in [n["name"] for n in tls.pool.nodes()]

    # the right pin: joined, the certificate kept, and work runs over HTTPS
    proc, agent_dir, log = _agent(tls, "pinned", token)
    try:
        wait_for("the node", lambda: "pinned" in [n["name"] for n in tls.pool.nodes()], 60, log.read_text)
        assert file_fingerprint(agent_dir / "server-ca.pem") == pin
        job = tls.pool.job("print('over tls')", gpus=1)
        wait_for("the job", lambda: tls.pool.state(job) == "released", 60, log.read_text)
        assert "over tls" in tls.pool.logs(job)
    finally:
        assert stop(proc) == 0
    # a restart needs no token: the kept certificate is the trust anchor from now on
    proc, _, log = _agent(tls, "pinned", "")
    try:
        wait_for("the restarted agent", lambda: "talking to" in log.read_text(), 60, log.read_text)
        assert proc.poll() is None, log.read_text()
    finally:
        assert stop(proc) == 0
