"""What `cpool run` sends with a job and brings back: the code directory, stdin, environment and
the files named by `--output`.

The directory (the current one, or `--workdir`) goes as a deterministic tar.gz (client/archive.py)
whose sha256 the server may hold already: then nothing is sent again. Everything here happens
before the allocation is created, so a refusal (over a cap, a bad env line) leaves nothing behind.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from computepool.cli.common import err_console
from computepool.client import PoolClient, PoolError
from computepool.core.errors import InvalidInput

if TYPE_CHECKING:  # the wire's models load pydantic: not at the CLI's start-up
    from computepool.wire.allocations import AllocationCreate

MIB = 1 << 20
MAX_CODE_BYTES = 1 << 30  # what a directory may hold before packing it is refused outright
WARN_CODE_BYTES = 100 * MIB  # past this, a line says so and names the biggest files
MAX_STDIN_BYTES = 1 << 30
_ENV_KEY_FIRST = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz_")


def _size(n: int) -> str:
    return f"{n / MIB:.1f} MiB" if n >= 100 * 1024 else f"{n / 1024:.1f} KiB"


def _largest(files: tuple[tuple[str, int], ...]) -> str:
    return ", ".join(f"{name} {_size(n)}" for name, n in files) or "none"


def _env_pair(text: str, where: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise InvalidInput(where, f"expected KEY=VALUE, got {text!r}")
    if key[0] not in _ENV_KEY_FIRST or not all(c.isalnum() or c == "_" for c in key) or not key.isascii():
        raise InvalidInput(where, f"{key!r} is not a variable name (letters, digits, '_'; not first a digit)")
    return key, value


def parse_env(pairs: list[str] | None, env_file: Path | None) -> dict[str, str] | None:
    """`--env-file` lines (KEY=VALUE, `# comments`, blank lines, an optional `export `), then `--env`
    pairs over them. A bad line names the file and its line number."""
    env: dict[str, str] = {}
    if env_file is not None:
        try:
            lines = env_file.expanduser().read_text().splitlines()
        except OSError as e:
            raise InvalidInput("--env-file", f"cannot read {env_file}: {e.strerror or e}") from None
        for n, raw in enumerate(lines, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            line = line.removeprefix("export ").lstrip()
            key, value = _env_pair(line, f"--env-file {env_file}:{n}")
            value = value.strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            env[key] = value
    for pair in pairs or []:
        key, value = _env_pair(pair, "--env")
        env[key] = value
    return env or None


def read_stdin(enabled: bool = True) -> bytes | None:
    """What is piped into `cpool run` (a pipe or a file, not a terminal or /dev/null), capped."""
    if not enabled or sys.stdin is None:
        return None
    try:
        fd = sys.stdin.fileno()
        mode = os.fstat(fd).st_mode
    except (OSError, ValueError):
        return None
    if not (stat.S_ISFIFO(mode) or stat.S_ISREG(mode)):
        return None  # a terminal, /dev/null or another device, a socket: nothing to send
    data = sys.stdin.buffer.read(MAX_STDIN_BYTES + 1)
    if len(data) > MAX_STDIN_BYTES:
        raise InvalidInput(
            "stdin", f"more than {MAX_STDIN_BYTES // MIB} MiB piped in: pass a file with the code"
        )
    return data


def check_outputs(outputs: list[str] | None) -> list[str]:
    """`--output` paths: relative to the job's work dir, never leaving it."""
    out: list[str] = []
    for raw in outputs or []:
        p = PurePosixPath(raw)
        if not raw or p.is_absolute() or ".." in p.parts or str(p) == ".":
            raise InvalidInput("--output", f"{raw!r}: give a path inside the job's work dir, e.g. out/")
        out.append(str(p))
    return out


def ship(
    pool: PoolClient,
    req: AllocationCreate,
    *,
    workdir: Path | None,
    no_code: bool,
    env: dict[str, str] | None,
    stdin: bytes | None,
    env_file: Path | None = None,
) -> AllocationCreate:
    """Upload the code directory and stdin (unless the pool holds them) and name them in the request.

    The `env_file` (its variables go in the request) is not shipped in the code, nor are files
    named like credentials (archive.SECRET_PATTERNS): one line says which were left out."""
    changes: dict[str, object] = {}
    if env:
        changes["env"] = {**(req.env or {}), **env}
    if not no_code:
        from computepool.client.archive import inside, pack_with_stats, scan  # tar code: when shipping

        root = (workdir or Path.cwd()).expanduser()
        if not root.is_dir():
            raise InvalidInput("--workdir", f"{root}: not a directory")
        found = inside(root, env_file) if env_file is not None else None
        leave_out = (found,) if found is not None else ()
        seen = scan(root, leave_out)
        if seen.bytes_in > MAX_CODE_BYTES:
            raise InvalidInput(
                "--workdir",
                f"{root} holds {_size(seen.bytes_in)} to ship (more than {MAX_CODE_BYTES // MIB} MiB; "
                f"largest: {_largest(seen.largest)}): ship a smaller one with --workdir, leave files out "
                "with .cpoolignore, or use --no-code",
            )
        if seen.bytes_in > WARN_CODE_BYTES:
            err_console.print(
                f"code: {root} holds {_size(seen.bytes_in)} in {seen.files} files (largest: "
                f"{_largest(seen.largest)}); leave what the job does not need out with .cpoolignore",
                highlight=False,
                markup=False,
                soft_wrap=True,
            )
        data, stats = pack_with_stats(root, leave_out=leave_out)
        try:
            sha, sent = pool.put_blob_info(data)
        except PoolError as e:
            raise PoolError(e.status, f"code ({root}): {e.message}", e.field) from None
        note = "uploaded" if sent else "already on the pool"
        left = f"; {stats.links_left_out} link(s) leading outside it left out" if stats.links_left_out else ""
        packed = f"{_size(len(data))} packed from {_size(stats.bytes_in)} in {stats.files} files"
        err_console.print(
            f"code: {packed} ({note}){left}",
            style="dim",
            highlight=False,
            markup=False,
        )
        if stats.secrets_left_out:
            err_console.print(
                secrets_note(list(stats.secrets_left_out)), highlight=False, markup=False, soft_wrap=True
            )
        changes["code"] = sha
    if stdin is not None:
        try:
            changes["stdin"] = pool.put_blob(stdin)
        except PoolError as e:
            raise PoolError(e.status, f"stdin: {e.message}", e.field) from None
    return req.changed(**changes) if changes else req


def secrets_note(names: list[str]) -> str:
    """One line naming what the code left out as secrets, and how to ship one anyway."""
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return f"code: left out {shown} (--env-file or a secret's usual name; `!NAME` in .cpoolignore ships it)"


def fetch_outputs(pool: PoolClient, job_id: str, outputs: list[str], base: Path) -> list[str]:
    """Bring each `--output` path back under `base` (same relative path); the errors, one line each."""
    errors: list[str] = []
    for path in outputs:
        left_out: list[str] = []
        try:
            # unpacked beside the target and moved into place as `cp` would: never written through
            # a link that happens to stand in the local directory
            parent = (base / path).parent
            parent.mkdir(parents=True, exist_ok=True)
            pool.download(job_id, path, parent, left_out=left_out)
        except (PoolError, ValueError, OSError) as e:
            message = e.message if isinstance(e, PoolError) else str(e)
            errors.append(f"--output {path}: {message}")
            continue
        from computepool.client.archive import remember_fetched  # tar code: only once files came back

        remember_fetched(base, path)  # the next run does not ship it back
        err_console.print(f"output: {path} → {base / path}", style="dim", highlight=False, markup=False)
        if left_out:
            err_console.print(left_out_note(sorted(left_out)), style="dim", highlight=False, markup=False)
    return errors


def left_out_note(names: list[str]) -> str:
    """One line naming what a fetch did not bring back (links leading out of the job's work dir)."""
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return f"left out {len(names)} link(s) leading outside the job's work dir (or special files): {shown}"
