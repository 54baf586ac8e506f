"""One Unix user per tenant on a node, so the kernel keeps tenants' jobs apart.

The agent (as root) creates `cpool-<tenant>` (another prefix for a second pool on the host:
`--tenant-user-prefix`, so that one pool's tenant never shares a uid with another pool's tenant of
the same name) with Debian's `groupadd`/`useradd --system` the first
time a tenant's job lands on the node and reuses it afterwards. Its uid (and the gid of its own
group, the same number) comes from a configurable range, so the pool's users are easy to tell
apart from the host's and never collide with them: a name or number already taken by something
that is not the pool's is refused, never reused.
"""

from __future__ import annotations

import grp
import hashlib
import os
import pwd
import re
import subprocess
import threading

from computepool.core.errors import InvalidInput

DEFAULT_UID_RANGE = (61000, 61999)
USER_PREFIX = "cpool-"
_PREFIX = re.compile(r"^[a-z][a-z0-9]{0,7}-$")
MAX_USER_NAME = 32
_COMMENT_PREFIX = "computepool tenant "
_PLAIN = re.compile(r"^[a-z0-9][a-z0-9_-]*$")
_NO_HOME = "/nonexistent"
_NO_SHELL = "/usr/sbin/nologin"
_lock = threading.Lock()


class TenantUserError(Exception):
    """The tenant's user cannot be made or used; the message says why (for the job's reason)."""


def parse_uid_range(text: str) -> tuple[int, int]:
    """`61000-61999` → (61000, 61999); a bad range names the option."""
    lo_s, sep, hi_s = text.partition("-")
    try:
        lo, hi = int(lo_s), int(hi_s)
    except ValueError:
        raise InvalidInput("uid-range", f"expected FIRST-LAST, e.g. 61000-61999, got {text!r}") from None
    if not sep or not 1000 <= lo <= hi < 2**31 - 1:
        raise InvalidInput("uid-range", f"expected 1000 <= FIRST <= LAST, got {text!r}")
    return lo, hi


def check_prefix(prefix: str) -> str:
    """`prefix` if it can start a user name: a letter, up to 7 letters or digits, then `-`."""
    if not _PREFIX.match(prefix):
        raise InvalidInput("tenant-user-prefix", f"expected a letter, up to 7 more, then '-', got {prefix!r}")
    return prefix


def user_name(tenant: str, prefix: str = USER_PREFIX) -> str:
    """`<prefix><tenant>`, or a shortened name with a hash where the tenant's name would not fit."""
    if not tenant:
        raise InvalidInput("tenant", "a job needs a tenant to choose its user")
    plain = prefix + tenant
    if _PLAIN.match(tenant) and len(plain) <= MAX_USER_NAME:
        return plain
    digest = hashlib.sha256(tenant.encode()).hexdigest()[:8]
    stem = re.sub(r"[^a-z0-9_-]+", "_", tenant.lower())[: MAX_USER_NAME - len(prefix) - 9]
    return f"{prefix}{stem}-{digest}"


def _ours(user: pwd.struct_passwd, tenant: str, uid_range: tuple[int, int]) -> bool:
    lo, hi = uid_range
    return lo <= user.pw_uid <= hi and user.pw_gecos == _COMMENT_PREFIX + tenant


def _free_id(uid_range: tuple[int, int]) -> int:
    lo, hi = uid_range
    used_uids = {u.pw_uid for u in pwd.getpwall()}
    used_gids = {g.gr_gid for g in grp.getgrall()}
    for n in range(lo, hi + 1):
        if n not in used_uids and n not in used_gids:
            return n
    raise TenantUserError(f"no free uid left in the pool's range {lo}-{hi} (see --uid-range)")


def _lookup(name: str) -> pwd.struct_passwd | None:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        return None


def _check(user: pwd.struct_passwd, tenant: str, uid_range: tuple[int, int]) -> pwd.struct_passwd:
    if not _ours(user, tenant, uid_range):
        raise TenantUserError(
            f"user {user.pw_name} (uid {user.pw_uid}) exists but is not the pool's user for tenant "
            f"{tenant!r} (uid range {uid_range[0]}-{uid_range[1]}); refusing to run the job as it"
        )
    return user


def ensure_tenant_user(
    tenant: str, uid_range: tuple[int, int] = DEFAULT_UID_RANGE, prefix: str = USER_PREFIX
) -> pwd.struct_passwd:
    """The tenant's user, created if missing (root only). Raises TenantUserError with the reason."""
    name = user_name(tenant, prefix)
    with _lock:
        existing = _lookup(name)
        if existing is not None:
            return _check(existing, tenant, uid_range)
        if os.geteuid() != 0:
            raise TenantUserError(f"user {name} does not exist and the agent is not root to create it")
        for _ in range(5):  # another agent on this host may take the same number at the same moment
            n = _free_id(uid_range)
            made = _create(name, n, tenant)
            existing = _lookup(name)
            if existing is not None:
                return _check(existing, tenant, uid_range)
            if made:
                break
        raise TenantUserError(f"could not create user {name} for tenant {tenant!r}")


def _create(name: str, n: int, tenant: str) -> bool:
    """groupadd + useradd with one number; False (and nothing left behind) when it was taken."""
    group = _run(["groupadd", "--system", "--gid", str(n), name])
    if group.returncode not in (0, 9):  # 9: the group name exists (a half-made earlier try)
        return False
    gid = grp.getgrnam(name).gr_gid
    user = _run(
        ["useradd", "--system", "--uid", str(n), "--gid", str(gid), "--no-create-home",
         "--home-dir", _NO_HOME, "--shell", _NO_SHELL, "--comment", _COMMENT_PREFIX + tenant, name]
    )  # fmt: skip
    if user.returncode != 0 and _lookup(name) is None:
        _run(["groupdel", name])
        return False
    return True


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise TenantUserError(f"{argv[0]} failed: {e}") from None


def remove_tenant_user(
    tenant: str, uid_range: tuple[int, int] = DEFAULT_UID_RANGE, prefix: str = USER_PREFIX
) -> bool:
    """Delete the tenant's user and group if they are the pool's (for operators and tests)."""
    name = user_name(tenant, prefix)
    with _lock:
        user = _lookup(name)
        if user is None or not _ours(user, tenant, uid_range):
            return False
        _run(["userdel", name])
        _run(["groupdel", name])  # userdel removes a user's own group already on Debian; harmless
        return _lookup(name) is None
