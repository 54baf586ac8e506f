"""A container whose image declares a VOLUME writes there.

podman makes an anonymous volume for each VOLUME of an image (owned by the container's user, so
writable by the tenant whatever the image holds) in its storage on the node's disk: outside the
job's dir and outside the container's writable layer, so the disk guard counted none of it (B
filled the disk and the guard stopped A's job, the biggest it saw), and `podman rm` without
`--volumes` left it behind after the job, for good. An image's volumes are now tmpfs mounts:
charged to the container's memory, gone with it.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from computepool.agent.container import Podman
from computepool.agent.executor import JobSpec

UID = 61991  # any uid: the container needs no passwd entry for it
BASE = "localhost/pybase:1"


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
