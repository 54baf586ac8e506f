"""One process per data dir: the lock, its holders' names, and the descriptor `cpool up` hands down."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from computepool.core.dirlock import LOCK_FD_ENV, LOCK_FILE, DataDirBusy, lock_data_dir

CHILD = """
import json, sys
from computepool.core.dirlock import DataDirBusy, lock_data_dir
try:
    lock_data_dir(__import__("pathlib").Path(sys.argv[1]), "cpool server")
    print("locked")
except DataDirBusy as e:
    print(e)
"""


def _child(data: Path, env: dict[str, str], pass_fds: tuple[int, ...] = ()) -> str:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(data)], capture_output=True, text=True, timeout=60,
        env={**os.environ, **env}, pass_fds=pass_fds,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_second_lock_fails_naming_the_holder_and_a_released_one_is_free(tmp_path: Path) -> None:
    data = tmp_path / "fresh" / "data"
    held = lock_data_dir(data, "cpool agent")
    assert (data.stat().st_mode & 0o777) == 0o700
    assert json.loads((data / LOCK_FILE).read_text()) == {"pid": os.getpid(), "command": "cpool agent"}
    with pytest.raises(DataDirBusy) as e:
        lock_data_dir(data, "cpool agent")
    assert str(e.value).startswith(f"data dir {data} is in use by pid {os.getpid()} (cpool agent);")
    assert "\n" not in str(e.value)
    out = _child(data, {})
    assert out.startswith(f"data dir {data} is in use by pid {os.getpid()} (cpool agent)"), out
    held.release()
    assert _child(data, {}) == "locked"
    lock_data_dir(data, "cpool agent").release()


def test_the_descriptor_handed_down_shares_the_lock_and_names_both(tmp_path: Path) -> None:
    held = lock_data_dir(tmp_path, "cpool up")
    assert _child(tmp_path, {LOCK_FD_ENV: str(held.fd)}, (held.fd,)) == "locked"
    lines = [json.loads(x) for x in (tmp_path / LOCK_FILE).read_text().splitlines()]
    assert [x["command"] for x in lines] == ["cpool up", "cpool server"]
    with pytest.raises(DataDirBusy, match=rf"in use by pid {os.getpid()} \(cpool up\);"):
        lock_data_dir(tmp_path, "cpool server")  # the child has ended: only the live holder is named
    held.release()


def test_a_forged_descriptor_takes_no_lock_another_holds(tmp_path: Path) -> None:
    held = lock_data_dir(tmp_path, "cpool server")
    other = os.open(tmp_path / LOCK_FILE, os.O_RDONLY)  # the same file, but not the holder's open file
    elsewhere = os.open(tmp_path / "other", os.O_RDWR | os.O_CREAT)
    try:
        for fd in (other, elsewhere):
            out = _child(tmp_path, {LOCK_FD_ENV: str(fd)}, (fd,))
            assert out.startswith(f"data dir {tmp_path} is in use by pid {os.getpid()} (cpool server)"), out
    finally:
        os.close(other)
        os.close(elsewhere)
        held.release()
