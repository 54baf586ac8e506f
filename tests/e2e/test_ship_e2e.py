"""Shipping code and data with `cpool run`, and getting files back, for real: `cpool server` and a root
`cpool agent` on loopback, two tenants, and the CLI as a user runs it (from a project directory).

The server's blob cap is 1 MiB here, so an over-cap upload is cheap to show.
"""

from __future__ import annotations

import io
import json
import os
import pwd
import shutil
import sqlite3
import subprocess
import tarfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_helpers import JOB_PYTHON, child_env, cpool, free_port, publish_image, stop, wait_for

from computepool.agent.tenants import remove_tenant_user, user_name
from computepool.core.tarsafe import sha256_hex

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="tenant users need a root agent"),
]

TRAIN = """\
import os, sys
names = sorted(os.path.relpath(os.path.join(d, f), '.') for d, _, fs in os.walk('.') for f in fs)
print('FILES ' + ' '.join(n for n in names if not n.startswith('.cpool')))
from sub.helper import greet
print(greet(), os.environ.get('GREETING'), os.environ.get('FROM_FILE'), os.environ.get('QUOTED'))
os.makedirs('out/deep', exist_ok=True)
open('out/result.txt', 'w').write('result 42\\n')
open('out/deep/more.txt', 'w').write('more\\n')
os.symlink('/etc/passwd', 'leak')
os.symlink('/etc/passwd', 'out/leak')
print('LINKED', open('abs_link').read().strip())
"""


class Pool:
    """`cpool server --blob-max-mib 1` and a root `cpool agent`, with data dirs in a root-only (0700)
    directory under /var/tmp, as under /root for a default `cpool up`: no tenant may pass it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.srv_dir, self.agent_dir = root / "srv", root / "agent"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.tenants: list[str] = []

    def start(self) -> None:
        env = child_env()
        with (self.root / "server.log").open("ab") as out:
            self.procs.append(
                subprocess.Popen(
                    cpool(
                        "server",
                        "--data-dir",
                        str(self.srv_dir),
                        "--port",
                        str(self.port),
                        "--blob-max-mib",
                        "1",
                    ),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                )  # fmt: skip
            )
        wait_for("the server", lambda: httpx.get(f"{self.url}/readyz").is_success, 60, self.logs)
        token = (self.srv_dir / "admin-token").read_text().strip()
        self.admin = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=10)
        join = self.admin.post("/api/v1/join-tokens", json={}).json()["token"]
        with (self.root / "agent.log").open("ab") as out:
            self.procs.append(
                subprocess.Popen(
                    cpool(
                        "agent",
                        "--server",
                        self.url,
                        "--join-token",
                        join,
                        "--data-dir",
                        str(self.agent_dir),
                        "--name",
                        "box",
                        "--kill-grace-s",
                        "1",
                    ),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                )  # fmt: skip
            )
        wait_for("the node", lambda: [n["state"] for n in self.admin.get("/api/v1/nodes").json()["items"]]
                 == ["ready"], 60, self.logs)  # fmt: skip

    def logs(self) -> str:
        return "\n".join(
            (self.root / f).read_text() for f in ("server.log", "agent.log") if (self.root / f).exists()
        )

    def member(self, tenant: str) -> str:
        """A member of a new tenant; its token."""
        assert self.admin.post("/api/v1/tenants", json={"name": tenant}).status_code == 201
        self.tenants.append(tenant)
        r = self.admin.post("/api/v1/users", json={"name": f"u-{tenant}", "tenant": tenant, "role": "member"})
        assert r.status_code == 201, r.text
        return str(self.admin.post("/api/v1/tokens", json={"user": f"u-{tenant}"}).json()["token"])

    def cli(
        self, token: str, *args: str, cwd: Path, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        env = {
            **child_env(),
            "CPOOL_SERVER": self.url,
            "CPOOL_TOKEN": token,
            "NO_COLOR": "1",
            "COLUMNS": "200",
        }
        return subprocess.run(
            cpool(*args), cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
            input=stdin, stdin=subprocess.DEVNULL if stdin is None else None,
        )  # fmt: skip

    def blob_rows(self) -> int:
        with sqlite3.connect(self.srv_dir / "pool.db") as db:
            return int(db.execute("SELECT count(*) FROM blobs").fetchone()[0])

    def allocations(self) -> list[dict[str, Any]]:
        return list(self.admin.get("/api/v1/allocations").json()["items"])

    def close(self) -> None:
        for proc in reversed(self.procs):
            stop(proc)
        for t in self.tenants:
            remove_tenant_user(t)


@pytest.fixture(scope="module")
def pool() -> Iterator[Pool]:
    root = Path("/var/tmp") / f"cpool-ship-{uuid.uuid4().hex[:8]}"
    root.mkdir(mode=0o700)
    os.chmod(root, 0o700)
    p = Pool(root)
    try:
        p.start()
        yield p
    finally:
        p.close()
        shutil.rmtree(root, ignore_errors=True)


def project(root: Path) -> Path:
    d = root / "proj"
    (d / "sub").mkdir(parents=True)
    (d / "build").mkdir()
    (d / "train.py").write_text(TRAIN)
    (d / "sub" / "__init__.py").write_text("")
    (d / "sub" / "helper.py").write_text("def greet():\n    return 'hello from helper'\n")
    (d / "secret.txt").write_text("not for the pool\n")
    (d / "build" / "artefact.o").write_bytes(b"\0" * 100)
    (d / "big.bin").write_bytes(b"\1" * 1000)
    (d / ".gitignore").write_text("secret.txt\nbuild/\n")
    (d / ".cpoolignore").write_text("big.bin\n")
    (d / "vars.env").write_text('# for the job\nFROM_FILE=from the file\n\nexport QUOTED="a b"\n')
    os.symlink(d / "sub" / "helper.py", d / "abs_link")  # absolute, inside: shipped as a relative link
    os.symlink("/etc/hostname", d / "outside")  # leads out: left out, and said so
    return d


def crafted(name: str, kind: str) -> bytes:
    """A tar.gz with one member that must never be unpacked: `../x`, `/abs`, or a link to /etc."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as tar:
        info = tarfile.TarInfo(name)
        if kind == "link":
            info.type, info.linkname = tarfile.SYMTYPE, "/etc"
            tar.addfile(info)
        else:
            info.size = 3
            tar.addfile(info, io.BytesIO(b"bad"))
    return raw.getvalue()


def test_ship_run_stdin_env_and_files_back(pool: Pool, tmp_path: Path) -> None:
    ta, tb = f"sa{uuid.uuid4().hex[:6]}", f"sb{uuid.uuid4().hex[:6]}"
    a, b = pool.member(ta), pool.member(tb)
    proj = project(tmp_path)
    args = ["run", "--cpus", "0.5", "--env", "GREETING=hi there", "--env-file", "vars.env", "--output", "out"]
    r = pool.cli(a, *args, "--", JOB_PYTHON, "train.py", cwd=proj)
    assert r.returncode == 0, r.stdout + r.stderr + pool.logs()
    files_line = next(line for line in r.stdout.splitlines() if line.startswith("FILES "))
    shipped = set(files_line.split()[1:])
    assert {"train.py", "sub/helper.py", "sub/__init__.py", ".gitignore"} <= shipped, shipped
    assert not {"secret.txt", "build/artefact.o", "big.bin", "outside", "vars.env"} & shipped, shipped
    assert "code: left out vars.env (--env-file" in r.stderr  # its variables went in the environment
    assert "hello from helper hi there from the file a b" in r.stdout
    assert "LINKED def greet():" in r.stdout
    assert "(uploaded); 1 link(s) leading outside it left out" in r.stderr and "code:" in r.stderr
    assert "left out 1 link(s) leading outside the job's work dir (or special files): out/leak" in r.stderr
    assert not (proj / "out" / "leak").is_symlink()
    # --output brought the job's out/ back next to the code, same relative path
    assert (proj / "out" / "result.txt").read_text() == "result 42\n"
    assert (proj / "out" / "deep" / "more.txt").read_text() == "more\n"
    job = pool.allocations()[0]
    code_sha = job["request"]["code"]
    # the shipped files were the tenant's user's on the node
    work = pool.agent_dir / "runs" / str(job["id"]) / "1" / "work"
    assert (work / "train.py").stat().st_uid == pwd.getpwnam(user_name(ta)).pw_uid
    rows = pool.blob_rows()

    # the same directory again: not uploaded again
    shutil.rmtree(proj / "out")
    r2 = pool.cli(
        a, "run", "--cpus", "0.5", "--env-file", "vars.env", "--", JOB_PYTHON, "-c",
        "print(open('train.py').read()[:9])", cwd=proj,
    )  # fmt: skip
    assert r2.returncode == 0, r2.stderr
    assert "(already on the pool)" in r2.stderr and "import os" in r2.stdout
    assert pool.blob_rows() == rows
    assert pool.allocations()[0]["request"]["code"] == code_sha

    # stdin piped to the job; --no-code ships nothing
    r3 = pool.cli(a, "run", "--no-code", "--cpus", "0.5", "--", "cat", cwd=tmp_path, stdin="hi\nthere\n")
    assert r3.returncode == 0 and r3.stdout == "hi\nthere\n", r3.stdout + r3.stderr
    assert "code:" not in r3.stderr

    # cpool cp after the job ended: a file, then a directory (into an existing one)
    dest = tmp_path / "got"
    dest.mkdir()
    c1 = pool.cli(a, "cp", f"{job['id']}:out/result.txt", str(dest / "r.txt"), cwd=tmp_path)
    assert c1.returncode == 0, c1.stderr
    assert (dest / "r.txt").read_text() == "result 42\n"
    c2 = pool.cli(a, "cp", f"{job['id']}:out", str(dest), cwd=tmp_path)
    assert c2.returncode == 0, c2.stderr
    assert (dest / "out" / "deep" / "more.txt").read_text() == "more\n"
    assert "left out 1 link(s)" in c2.stderr and not (dest / "out" / "leak").is_symlink()
    # a file over a directory: refused like cp does, one line, no temporary path shown
    (dest / "clash" / "result.txt").mkdir(parents=True)
    c6 = pool.cli(a, "cp", f"{job['id']}:out/result.txt", str(dest / "clash"), cwd=tmp_path)
    assert c6.returncode != 0 and "Traceback" not in c6.stderr
    clash = dest / "clash" / "result.txt"
    assert c6.stderr.strip() == f"error: cannot overwrite directory {clash} with a file", c6.stderr
    assert list((dest / "clash").iterdir()) == [dest / "clash" / "result.txt"]
    # a link leading out of the work dir, and a missing path: one readable line, non-zero
    c3 = pool.cli(a, "cp", f"{job['id']}:leak", str(dest), cwd=tmp_path)
    assert c3.returncode != 0 and "outside the job's work dir" in c3.stderr and "Traceback" not in c3.stderr
    c4 = pool.cli(a, "cp", f"{job['id']}:nope.txt", str(dest), cwd=tmp_path)
    assert c4.returncode != 0 and "no such file" in c4.stderr, c4.stderr
    assert not (dest / "leak").exists() and not (dest / "nope.txt").exists()

    # tenant B: A's blob and A's files answer 404, like things that do not exist
    hb = httpx.Client(base_url=pool.url, headers={"Authorization": f"Bearer {b}"}, timeout=10)
    assert hb.head(f"/api/v1/blobs/{code_sha}").status_code == 404
    assert hb.get(f"/api/v1/blobs/{code_sha}").status_code == 404
    theirs = hb.post(f"/api/v1/allocations/{job['id']}/files", json={"path": "out"})
    assert theirs.status_code == 404 and theirs.json()["error"] == f"allocation '{job['id']}' not found"
    c5 = pool.cli(b, "cp", f"{job['id']}:out", str(dest / "b"), cwd=tmp_path)
    assert c5.returncode != 0 and "not found" in c5.stderr


def test_refusals_leave_nothing_behind(pool: Pool, tmp_path: Path) -> None:
    ta = f"sr{uuid.uuid4().hex[:6]}"
    a = pool.member(ta)
    before = len(pool.allocations())
    # over the server's 1 MiB cap: one line naming the sizes, no allocation
    big = tmp_path / "big"
    big.mkdir()
    (big / "weights.bin").write_bytes(os.urandom(2 << 20))
    r = pool.cli(a, "run", "--cpus", "0.5", "--", "true", cwd=big)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "over the per-upload cap of 1.0 MiB" in r.stderr and len(r.stderr.strip().splitlines()) == 1, (
        r.stderr
    )
    # past the local cap (a sparse 2 GiB file): refused before packing, naming the biggest files
    huge = tmp_path / "huge"
    huge.mkdir()
    with open(huge / "ckpt.bin", "wb") as f:
        f.truncate(2 << 30)
    r = pool.cli(a, "run", "--cpus", "0.5", "--", "true", cwd=huge)
    assert r.returncode == 2 and "largest: ckpt.bin 2048.0 MiB" in r.stderr, r.stderr
    # a bad --env-file line names the file and the line; a bad --env names the option
    (tmp_path / "bad.env").write_text("OK=1\nthis is not a pair\n")
    r = pool.cli(a, "run", "--no-code", "--env-file", "bad.env", "--", "true", cwd=tmp_path)
    assert r.returncode != 0 and "bad.env:2" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = pool.cli(a, "run", "--no-code", "--env", "1X=2", "--", "true", cwd=tmp_path)
    assert r.returncode != 0 and "--env" in r.stderr
    r = pool.cli(a, "run", "--no-code", "--output", "../up", "--", "true", cwd=tmp_path)
    assert r.returncode != 0 and "--output" in r.stderr
    r = pool.cli(a, "run", "--no-code", "--detach", "--output", "out", "--", "true", cwd=tmp_path)
    assert r.returncode != 0 and "not with --detach" in r.stderr
    assert len(pool.allocations()) == before


@pytest.mark.parametrize(
    ("name", "kind", "why"),
    [("../x", "file", "'..'"), ("/abs", "file", "absolute"), ("etc", "link", "outside the archive")],
)
def test_the_agent_refuses_archives_that_leave_the_work_dir(
    pool: Pool, name: str, kind: str, why: str
) -> None:
    token = pool.member(f"sx{uuid.uuid4().hex[:6]}")
    user = httpx.Client(base_url=pool.url, headers={"Authorization": f"Bearer {token}"}, timeout=10)
    data = crafted(name, kind)
    sha = sha256_hex(data)
    assert user.put(f"/api/v1/blobs/{sha}", content=data).status_code == 201
    r = user.post("/api/v1/allocations", json={"command": ["true"], "cpu_milli": 100, "code": sha})
    assert r.status_code == 201, r.text
    aid = r.json()["id"]
    done = wait_for("the job's end", lambda: (j := user.get(f"/api/v1/allocations/{aid}").json())["state"]
                    in ("failed", "released") and j, 60, pool.logs)  # fmt: skip
    assert done["state"] == "failed" and "code: refused the archive" in done["reason"], done["reason"]
    assert why in done["reason"], done["reason"]
    assert not Path("/x").exists() and not Path("/abs").exists()
    assert json.dumps(done)  # the answer is plain JSON all the way


def path_max_exploit(target: Path) -> bytes:
    """The published tarfile filter bypass: nested 247-byte dirs and one-letter links to them, a link
    through the chain that climbs back past PATH_MAX, and a file written through `escape` into
    `target` — which, unpacked as root, wrote anywhere on the node."""
    raw = io.BytesIO()
    comp, steps, path = "d" * 247, "abcdefghijklmnop", ""

    def add(tar: tarfile.TarFile, name: str, kind: bytes, link: str = "", data: bytes = b"") -> None:
        info = tarfile.TarInfo(name)
        info.type, info.linkname, info.size, info.mode = kind, link, len(data), 0o755
        tar.addfile(info, io.BytesIO(data) if data else None)

    with tarfile.open(fileobj=raw, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
        for step in steps:
            add(tar, os.path.join(path, comp), tarfile.DIRTYPE)
            add(tar, os.path.join(path, step), tarfile.SYMTYPE, comp)
            path = os.path.join(path, comp)
        linkpath = os.path.join(*steps, "l" * 254)
        add(tar, linkpath, tarfile.SYMTYPE, os.path.join(*[".."] * len(steps)))
        add(tar, "escape", tarfile.SYMTYPE, linkpath + "/.." * 17 + str(target))
        add(tar, "escape/pwned", tarfile.REGTYPE, data=b"written as root\n")
    return raw.getvalue()


def test_the_path_max_exploit_cannot_write_on_the_node(pool: Pool) -> None:
    token = pool.member(f"sp{uuid.uuid4().hex[:6]}")
    user = httpx.Client(base_url=pool.url, headers={"Authorization": f"Bearer {token}"}, timeout=10)
    victim = pool.root / "victim"
    victim.mkdir(mode=0o755)
    data = path_max_exploit(victim)
    sha = sha256_hex(data)
    assert user.put(f"/api/v1/blobs/{sha}", content=data).status_code == 201
    r = user.post("/api/v1/allocations", json={"command": ["true"], "cpu_milli": 100, "code": sha})
    assert r.status_code == 201, r.text
    aid = r.json()["id"]
    done = wait_for("the job's end", lambda: (j := user.get(f"/api/v1/allocations/{aid}").json())["state"]
                    in ("failed", "released") and j, 60, pool.logs)  # fmt: skip
    assert done["state"] == "failed" and "code: refused the archive" in done["reason"], done["reason"]
    assert list(victim.iterdir()) == []


def test_code_and_stdin_reach_a_container_job(pool: Pool, image: str, tmp_path: Path) -> None:
    publish_image(pool.admin, image)
    token = pool.member(f"sc{uuid.uuid4().hex[:6]}")
    (tmp_path / "echo.py").write_text("import sys\nprint('container got', sys.stdin.read().strip())\n")
    r = pool.cli(token, "run", "--cpus", "0.5", "--image", image, "--", "python3", "echo.py", cwd=tmp_path,
                 stdin="piped words\n")  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr + pool.logs()
    assert "container got piped words" in r.stdout


def test_output_never_writes_through_a_local_link(pool: Pool, tmp_path: Path) -> None:
    """`--output out` where the local out/ holds a link to a file of the caller's: the job's file
    replaces the link; the file the link pointed at is left alone."""
    a = pool.member(f"sl{uuid.uuid4().hex[:6]}")
    here = tmp_path / "here"
    (here / "out").mkdir(parents=True)
    (here / "README.md").write_text("mine\n")
    (here / "out" / "x").symlink_to("../README.md")
    job = "import os; os.makedirs('out', exist_ok=True); open('out/x', 'w').write('from the job\\n')"
    r = pool.cli(a, "run", "--no-code", "--output", "out", "--", JOB_PYTHON, "-c", job, cwd=here)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (here / "README.md").read_text() == "mine\n"
    assert not (here / "out" / "x").is_symlink() and (here / "out" / "x").read_text() == "from the job\n"
