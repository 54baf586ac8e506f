"""Two pools on one host never hand one pool's tenant the other's caches.

A second pool's agents (`--tenant-user-prefix cpb-`) kept their tenants' caches in
`/var/cache/computepool/cpb/` by default: the very cache dir of the first pool's tenant named `cpb`.
That tenant's next job had the agent chown the dir to its user, and renamed a second-pool tenant's
cache away and put a dir of its own (a planted pip environment, say) in its place, which the
second pool then handed to that tenant. The second pool's default root is now a sibling
(`/var/cache/computepool-cpb`), and an agent never takes over a cache root that is not root's nor
a root-owned dir where a tenant's cache should be: the job that would have done so fails to start.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from computepool.agent.executor import Executor, JobSpec, SandboxConfig
from computepool.agent.localstate import JobState
from computepool.agent.tenants import remove_tenant_user

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="tenant users need root")

RANGE = (61000, 61999)
PREFIX_2 = "cpz-"  # the second pool's


class Pools:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.caches = Path("/var/lib") / f"cpool-caches-{uuid.uuid4().hex[:8]}"  # the first pool's root
        self.prefix_tenant = f"p{uuid.uuid4().hex[:8]}"  # the first pool's tenant named like the root
        self.victim = f"v{uuid.uuid4().hex[:8]}"  # the second pool's tenant
        self.first = Executor(
            root / "a1", cgroup_base=None, kill_grace_s=1.0,
            sandbox=SandboxConfig(uid_range=RANGE, cache_root=self.caches),
        )  # fmt: skip
        nested = self.caches / self.prefix_tenant  # the second pool's root, as `<first root>/<prefix>` was
        self.second = Executor(
            root / "a2", cgroup_base=None, kill_grace_s=1.0,
            sandbox=SandboxConfig(uid_range=RANGE, cache_root=nested, user_prefix=PREFIX_2),
        )  # fmt: skip

    def run(self, ex: Executor, key: str, tenant: str, script: str) -> tuple[JobState, str]:
        done = ex.wait(ex.start(JobSpec(key, 1, ["sh", "-c", script], tenant=tenant)).key, 20)
        return done.state, done.reason


@pytest.fixture
def pools() -> Iterator[Pools]:
    root = Path("/var/tmp") / f"cpool-caches-{uuid.uuid4().hex[:8]}"
    root.mkdir(mode=0o755)
    p = Pools(root)
    yield p
    for ex in (p.first, p.second):
        ex.state.close()
    remove_tenant_user(p.prefix_tenant, RANGE)
    remove_tenant_user(p.victim, RANGE, PREFIX_2)
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(p.caches, ignore_errors=True)


def test_a_tenant_named_like_the_other_pools_cache_root_gets_none_of_its_caches(pools: Pools) -> None:
    p = pools
    state, why = p.run(p.second, "v1", p.victim, 'echo mine > "$CPOOL_CACHE_DIR/f"')
    assert state is JobState.SUCCEEDED, why
    victim_cache = p.caches / p.prefix_tenant / p.victim
    # the first pool's tenant: its cache would be the second pool's root, holding the victim's cache
    mine = f'"$CPOOL_CACHE_DIR/{p.victim}"'
    swap = f'mv {mine} "$CPOOL_CACHE_DIR/gone" && mkdir -m 777 {mine}'
    state, why = p.run(p.first, "t1", p.prefix_tenant, swap)
    assert state is not JobState.SUCCEEDED and "cache" in why, why
    assert (p.caches / p.prefix_tenant).stat().st_uid == 0
    assert (victim_cache / "f").read_text() == "mine\n"
    state, why = p.run(p.second, "v2", p.victim, 'cat "$CPOOL_CACHE_DIR/f"')
    assert state is JobState.SUCCEEDED, why


def test_a_cache_root_a_tenant_owns_is_not_taken_over(pools: Pools) -> None:
    p = pools
    state, why = p.run(p.first, "t1", p.prefix_tenant, 'echo own > "$CPOOL_CACHE_DIR/f"')
    assert state is JobState.SUCCEEDED, why
    owner = (p.caches / p.prefix_tenant).stat().st_uid
    state, why = p.run(p.second, "v1", p.victim, "true")
    assert state is not JobState.SUCCEEDED and "cache" in why, why
    assert (p.caches / p.prefix_tenant).stat().st_uid == owner != 0  # still the first pool's tenant's
