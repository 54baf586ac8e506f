"""What a container's image declares beyond its files: a VOLUME, a HEALTHCHECK.

A VOLUME:
podman makes an anonymous volume for each VOLUME of an image (owned by the container's user, so
writable by the tenant whatever the image holds) in its storage on the node's disk: outside the
job's dir and outside the container's writable layer, so the disk guard counted none of it (B
filled the disk and the guard stopped A's job, the biggest it saw), and `podman rm` without
`--volumes` left it behind after the job, for good. An image's volumes are now tmpfs mounts:
charged to the container's memory, gone with it.

A HEALTHCHECK: podman hands the image's check to systemd, which runs it every interval through
`podman healthcheck run`, an exec into the container from outside the agent: outside the Landlock
domain the container runs in (a worker container on the host's network then reached the node's
abstract unix sockets from its check, as `cpool exec` did before it was refused there). An image's
check is now turned off (`--no-healthcheck`).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from computepool.agent.container import Podman
from computepool.agent.executor import JobSpec

UID = 61991  # any uid: the container needs no passwd entry for it
BASE = "localhost/pybase:1"


def _image(containerfile: str) -> str:
    """An image built from the test image with `containerfile`'s lines (no step runs anything)."""
    tag = f"localhost/cpool-img-{uuid.uuid4().hex[:8]}:1"
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "Containerfile").write_text(f"FROM {BASE}\n{containerfile}\n")
        build = ["podman", "build", "-q", "--format", "docker", "-t", tag, d]
        subprocess.run(build, capture_output=True, check=True, timeout=120)
    return tag


@pytest.fixture
def volume_image(image: str) -> Iterator[str]:
    """The test image with `VOLUME /data` (an allowed registry's image, or a published one, may)."""
    tag = f"localhost/cpool-vol-{uuid.uuid4().hex[:8]}:1"
    made = subprocess.run(["podman", "create", BASE, "true"], capture_output=True, text=True, check=True)
    box = made.stdout.strip()
    try:
        commit = ["podman", "commit", "-q", "--change", "VOLUME /data", box, tag]
        subprocess.run(commit, capture_output=True, check=True)
    finally:
        subprocess.run(["podman", "rm", "-f", box], capture_output=True, check=False)
    yield tag
    subprocess.run(["podman", "rmi", "-f", tag], capture_output=True, check=False)


def test_an_images_volume_is_neither_on_the_nodes_disk_nor_left_behind(
    volume_image: str, tmp_path: Path
) -> None:
    podman = Podman(tmp_path / "agent", node_name="test-node")
    work = tmp_path / "run" / "work"
    work.mkdir(parents=True)
    os.chown(work, UID, UID)
    code = "open('/data/fill.bin', 'wb').write(b'x' * (1 << 20)); print('wrote')"
    s = JobSpec("a8", 1, ["python3", "-c", code], tenant="acme", image=volume_image, memory_mib=64)
    volumes: list[str] = []
    try:
        done = subprocess.run(
            podman.run_argv(s, work, UID, UID), capture_output=True, text=True, timeout=60, env={}, cwd=work,
            check=False,
        )  # fmt: skip
        assert done.returncode == 0 and "wrote" in done.stdout, done.stderr[-2000:]
        shown = subprocess.run(
            ["podman", "inspect", "--format", "{{json .Mounts}}", podman.name(s.key)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        volumes = [m["Name"] for m in json.loads(shown.stdout) if m.get("Type") == "volume"]
        podman.remove(s.key)
        left = [v for v in volumes if subprocess.run(["podman", "volume", "exists", v]).returncode == 0]
        assert volumes == [] and left == [], (volumes, left)
    finally:
        for key in podman.all_keys():
            podman.remove(key)
        for v in volumes:
            subprocess.run(["podman", "volume", "rm", "-f", v], capture_output=True, check=False)


def test_an_images_healthcheck_is_never_run_from_outside_the_container(image: str, tmp_path: Path) -> None:
    tag = _image('HEALTHCHECK --interval=5s CMD ["python3", "-c", "print(1)"]')
    podman = Podman(tmp_path / "agent", node_name="test-node")
    work = tmp_path / "run" / "work"
    work.mkdir(parents=True)
    os.chown(work, UID, UID)
    s = JobSpec("a9", 1, ["true"], tenant="acme", image=tag, memory_mib=64)
    try:
        done = subprocess.run(
            podman.run_argv(s, work, UID, UID), capture_output=True, text=True, timeout=60, env={}, cwd=work,
            check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        shown = subprocess.run(
            ["podman", "inspect", "--format", "{{json .Config.Healthcheck}}", podman.name(s.key)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        check = json.loads(shown.stdout) or {}
        assert check.get("Test", ["NONE"]) == ["NONE"], check  # (it was the image's command)
    finally:
        for key in podman.all_keys():
            podman.remove(key)
        subprocess.run(["podman", "rmi", "-f", tag], capture_output=True, check=False)
