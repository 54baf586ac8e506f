"""The secrets a user keeps beside the code are not shipped with it.

`cpool run --env-file .env` once put the variables in the job's environment and also packed `.env`
into the code archive, so the secret lay readable in the job's work dir (and in the pool's blob
store, for anyone running the same code). The `--env-file` and files named like credentials are
left out of the code now, named in one line on stderr, unless `.cpoolignore` re-includes one.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from e2e_helpers import JOB_PYTHON, cpool
from job_node import job_node

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="tenant users need a root agent")]

LOOK = """\
import json, os
names = ['.env', 'deploy.pem', 'keys/id_rsa', 'keep.pem', 'main.py']
print(json.dumps({'env': os.environ.get('API_KEY'), **{n: os.path.exists(n) for n in names}}))
"""


def test_the_env_file_and_key_files_are_not_in_the_jobs_work_dir(tmp_path: Path) -> None:
    project = tmp_path / "project"
    (project / "keys").mkdir(parents=True)
    (project / ".env").write_text("API_KEY=hunter2\n")
    (project / "deploy.pem").write_text("-----BEGIN PRIVATE KEY-----\n")
    (project / "keys" / "id_rsa").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    (project / "keep.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    (project / ".cpoolignore").write_text("!keep.pem\n")
    (project / "main.py").write_text(LOOK)
    with job_node() as node:
        tenant, _ = node.member("sec")
        r = subprocess.run(
            cpool("run", "--cpus", "0.1", "--env-file", ".env", "--", JOB_PYTHON, "main.py"),
            cwd=project, env=node.cli_env(tenant), capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert r.returncode == 0, f"{r.stdout}\n{r.stderr}\n{node.logs()}"
        seen = json.loads(r.stdout.strip().splitlines()[-1])
        assert seen == {
            "env": "hunter2", ".env": False, "deploy.pem": False, "keys/id_rsa": False, "keep.pem": True,
            "main.py": True,
        }, seen  # fmt: skip
        [note] = [line for line in r.stderr.splitlines() if "left out" in line]
        assert "left out .env, deploy.pem, keys/id_rsa " in note and ".cpoolignore" in note, note
