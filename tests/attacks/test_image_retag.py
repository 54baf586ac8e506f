"""Another tenant's code inside your jobs, through the node's image store, on a real pool.

The attack: a tenant loaded an image archive whose tags renamed the victim's image on the node; the
victim's next container job ran the attacker's code with the victim's secrets. Now the transports
that load such archives are refused (here through the CLI, as a user would type them), and even
when a name on the node is made to mean another image (here by the test, as root, the way that
archive did), the victim's job runs the image id the pool pinned at admission.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_helpers import cpool, publish_image
from test_container_e2e import Node, _ended, _logs, _submit, _tenant, node, tenants

from computepool.agent.container import Podman

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="container jobs need a root agent (rootful podman)"),
]
__all__ = ["node", "tenants"]  # the end-to-end module's fixtures: one pool for this module

CHECK = "import os; print('EVIL' if os.path.exists('/evil') else 'clean', flush=True)"


def _podman(*args: str) -> str:
    done = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture
def names(image: str, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """A victim's image (a name of its own for the test image) and an attacker's image built on it."""
    tag = uuid.uuid4().hex[:8]
    victim, evil = f"localhost/cpool-victim-{tag}:1", f"localhost/cpool-evil-{tag}:1"
    _podman("tag", image, victim)
    (tmp_path / "evil").write_text("evil\n")
    base = _podman("image", "inspect", "--format", "{{.Id}}", image)
    (tmp_path / "Containerfile").write_text(f"FROM {base}\nCOPY evil /evil\n")
    _podman("build", "-q", "-t", evil, str(tmp_path))
    try:
        yield victim, evil
    finally:
        subprocess.run(["podman", "rmi", "-f", victim, evil], capture_output=True, timeout=120, check=False)


@pytest.mark.parametrize(
    "image_arg",
    [
        "docker-archive:/var/tmp/x.tar",
        "oci-archive:/var/tmp/x.tar",
        "oci:/var/tmp/layout",
        "dir:/root",
        "containers-storage:localhost/pybase:1",
        "docker-daemon:alpine:latest",
    ],
)
def test_cpool_run_refuses_every_transport_in_one_line(
    node: Node, tenants: list[str], image_arg: str, tmp_path: Path
) -> None:
    _, token, _ = _tenant(node, tenants, "ta")
    env = dict(node.env, CPOOL_SERVER=node.url, CPOOL_TOKEN=token)
    argv = cpool("run", "--image", image_arg, "--", "true")
    done = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "image" in lines[0] and "Traceback" not in done.stderr, done.stderr


def test_a_name_retagged_on_the_node_still_runs_the_published_image(
    node: Node, tenants: list[str], names: tuple[str, str]
) -> None:
    victim, evil = names
    client, _, tenant = _tenant(node, tenants, "tv")
    publish_image(node.admin, victim, [tenant])
    first = _submit(client, ["python3", "-c", CHECK], image=victim)
    assert _ended(node, client, first)["state"] == "released"
    assert "clean" in _logs(client, first)
    # what the attacker's archive did: the victim's name now means the attacker's image on the node
    _podman("tag", evil, victim)
    second = _submit(client, ["python3", "-c", CHECK], image=victim)
    assert _ended(node, client, second)["state"] == "released"
    assert "clean" in _logs(client, second) and "EVIL" not in _logs(client, second)


def test_a_tenant_cannot_run_an_image_it_was_not_given(
    node: Node, tenants: list[str], names: tuple[str, str]
) -> None:
    victim, _ = names
    owner, _, tenant = _tenant(node, tenants, "to")
    other, _, _ = _tenant(node, tenants, "tx")
    publish_image(node.admin, victim, [tenant])
    r = other.post("/api/v1/allocations", json={"command": ["true"], "cpu_milli": 100, "image": victim})
    assert r.status_code == 422 and r.json()["field"] == "image", r.text
    # on the node but never published: refused just the same
    r = other.post("/api/v1/allocations", json={"command": ["true"], "cpu_milli": 100, "image": names[1]})
    assert r.status_code == 422 and r.json()["field"] == "image", r.text


REGISTRY = "127.0.0.1:5999"  # allowed, never contacted: the node has the image by that name already


@pytest.fixture(scope="module")
def allowing(image: str) -> Iterator[Node]:
    """A second pool whose server allows one registry's images without publishing."""
    root = Path("/var/tmp") / f"cpool-reg-{uuid.uuid4().hex[:8]}"
    root.mkdir(mode=0o755)
    n = Node(root, "--allowed-registries", REGISTRY)
    try:
        yield n
    finally:
        n.close()
        podman = Podman(n.agent_dir)
        for key in podman.all_keys():
            podman.remove(key)
        shutil.rmtree(root, ignore_errors=True)


def test_an_allowed_registrys_image_is_run_by_id_and_the_id_is_kept(
    allowing: Node, tenants: list[str], image: str
) -> None:
    name = f"{REGISTRY}/team/app-{uuid.uuid4().hex[:8]}:1"
    _podman("tag", image, name)
    try:
        client, _, _ = _tenant(allowing, tenants, "tr")
        aid = _submit(client, ["python3", "-c", CHECK], image=name)
        assert _ended(allowing, client, aid)["state"] == "released"
        want = _podman("image", "inspect", "--format", "{{.Id}}", name)
        got = client.get(f"/api/v1/allocations/{aid}").json()["request"]
        assert got["image"] == name and got["image_digest"] == "sha256:" + want.removeprefix("sha256:")
        records = allowing.admin.get("/api/v1/audit", params={"action": "node.report"}).json()["items"]
        assert any(
            {"allocation": aid, "image_digest": got["image_digest"]} in (r["detail"] or {}).get("images", [])
            for r in records
        ), records
    finally:
        subprocess.run(["podman", "rmi", name], capture_output=True, timeout=120, check=False)
