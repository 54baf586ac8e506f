"""A container job's variables as podman's env file (`podman run --env-file`).

Podman's command line is readable by every user of the node (`ps`), and a job's environment
holds secrets (a replica's key, a worker's token, the user's own), so container.py passes them
in a file only root can read, in the attempt's root-owned run dir.
"""

from __future__ import annotations

import os
from pathlib import Path


class EnvFileError(ValueError):
    """A variable the env file cannot carry; the message names it and says why."""


ENV_FILE = "container.env"  # in the attempt's root-owned run dir, beside (not in) the job's work dir
ENV_LINE_MAX = 65_000  # podman reads an env file line by line, a line at most 64 KiB


def env_file_text(env: dict[str, str]) -> str:
    """The job's variables in podman's --env-file syntax, or EnvFileError naming the one it cannot
    carry. Podman takes each line as NAME=VALUE, the value verbatim up to the line's end (`=` and
    `#` included); it trims whitespace before the name, skips lines beginning with `#`, drops a
    carriage return before the line's end and refuses lines of 64 KiB."""
    lines = []
    for k, v in env.items():
        if not k or k.startswith("#") or any(c in k for c in "= \t\r\n\0"):
            raise EnvFileError(f"environment variable {k!r}: not a name a container's env file can carry")
        if any(c in v for c in "\r\n\0"):
            raise EnvFileError(
                f"environment variable {k}: a container job's variable cannot hold a line break "
                "(podman's env file has one line per variable); encode it, e.g. in base64"
            )
        line = f"{k}={v}"
        if len(line.encode()) > ENV_LINE_MAX:
            raise EnvFileError(f"environment variable {k}: longer than {ENV_LINE_MAX} bytes, podman's limit")
        lines.append(line + "\n")
    return "".join(lines)


def write_env_file(path: Path, env: dict[str, str]) -> Path:
    """The env file podman reads the job's variables from: root's own (0600), written afresh."""
    text = env_file_text(env)
    path.unlink(missing_ok=True)  # never write through a link or into a file someone else opened
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    return path
