"""A request for pooled capacity, validated once so every layer below can trust it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum

from computepool.core.allocation import Isolation
from computepool.core.errors import InvalidInput
from computepool.core.quantities import MILLI_PER_DEVICE
from computepool.core.resources import MIG_PROFILE
from computepool.core.vendors import VENDORS, canonical

_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
_STACK_NAME = re.compile(r"^[a-z][a-z0-9_]{0,30}$")
_VERSION = re.compile(r"^[0-9]+(?:\.[0-9A-Za-z]+){0,4}$")


def version_key(text: str) -> tuple[tuple[int, str], ...] | None:
    """`12.4` → comparable parts (numbers as numbers: 12.10 > 12.9; `8.0.RC2` keeps RC2 as text,
    after any number); None when it is not a version."""
    if not _VERSION.match(text):
        return None
    return tuple((int(p), "") if p.isdigit() else (1 << 30, p) for p in text.split("."))


def stack_at_least(have: str, want: str) -> bool:
    """Whether version `have` of a stack satisfies a request for `want` or later."""
    h, w = version_key(have), version_key(want)
    return h is not None and w is not None and h >= w


MAX_DEVICES_PER_NODE = 64
MAX_GANG_NODES = 4096


class Sharing(StrEnum):
    SHARED = "shared"
    EXCLUSIVE = "exclusive"


def parse_models(text: str | None, field: str = "models") -> frozenset[str] | None:
    """`V100M16|V100M32` → {"V100M16", "V100M32"}; empty → None (any model)."""
    if text is None:
        return None
    text = text.strip()
    if not text:
        return None
    parts = [p.strip() for p in text.split("|")]
    for p in parts:
        if not _MODEL_NAME.match(p):
            raise InvalidInput(field, f"bad model name {p!r} in {text!r} (expected names like A|B|C)")
    return frozenset(parts)


@dataclass(frozen=True)
class Request:
    """Devices × per-device share, host CPU and memory, constraints, gang and priority.

    `gpu_count` and the host quantities are per node; a gang asks for `gang_nodes` such nodes,
    bound all-or-nothing. `gpu_memory_mib=None` means "in proportion to the compute share".

    `isolation` is the tier its slices get (None: exclusive for whole devices, timeslice for a
    fraction); a device holds slices of one tier at a time. A `mig` request takes one whole MIG
    instance: of profile `mig_profile`, or else the smallest holding `gpu_memory_mib` and, for a
    fraction, at least `gpu_milli` of its GPU.
    """

    gpu_count: int = 0
    gpu_milli: int = 0
    gpu_memory_mib: int | None = None
    cpu_milli: int = 0
    memory_mib: int = 0
    models: frozenset[str] | None = None
    sharing: Sharing = Sharing.SHARED
    gang_nodes: int = 1
    priority: int = 0
    tenant: str = ""
    name: str = ""
    # node-level rules (scheduler/constraints.py): labels the node must carry, taints tolerated
    node_selector: tuple[tuple[str, str], ...] = ()
    tolerations: frozenset[str] = frozenset()
    isolation: Isolation | None = None
    mig_profile: str | None = None
    # a gang's members all on nodes sharing one value of this node label (e.g. "rack"); None: any
    colocate: str | None = None
    # device capability: vendors allowed (core/vendors.py names; None: any) and a floor on each
    # device's memory (its size, not what is free: `gpu_memory_mib` is what the slice takes)
    vendors: frozenset[str] | None = None
    min_gpu_memory_mib: int = 0
    # software stacks the node must provide, at least this version: (("cuda", "12.4"),) needs a
    # node labelled stack.cuda=12.4 or later (the agent labels what it finds)
    stacks: tuple[tuple[str, str], ...] = ()
    # derived in __post_init__ (read for every request the scheduler places)
    _tier: Isolation | None = field(init=False, repr=False, compare=False, default=None)
    _whole: bool = field(init=False, repr=False, compare=False, default=False)

    def __post_init__(self) -> None:
        for fname in ("gpu_count", "gpu_milli", "cpu_milli", "memory_mib", "gang_nodes"):
            v = getattr(self, fname)
            if isinstance(v, bool) or not isinstance(v, int):
                raise InvalidInput(fname, f"must be a whole number, got {v!r}")
            if v < 0:
                raise InvalidInput(fname, f"must not be negative, got {v}")
        if self.gpu_memory_mib is not None and (
            not isinstance(self.gpu_memory_mib, int) or self.gpu_memory_mib < 0
        ):
            raise InvalidInput(
                "gpu_memory_mib",
                f"must be a non-negative whole number of MiB, got {self.gpu_memory_mib!r}",
            )
        if self.gpu_count > MAX_DEVICES_PER_NODE:
            raise InvalidInput(
                "gpu_count",
                f"{self.gpu_count} devices per node is more than any node holds ({MAX_DEVICES_PER_NODE})",
            )
        if self.gang_nodes < 1 or self.gang_nodes > MAX_GANG_NODES:
            raise InvalidInput("gang_nodes", f"must be between 1 and {MAX_GANG_NODES}, got {self.gang_nodes}")
        if self.gpu_milli > MILLI_PER_DEVICE:
            raise InvalidInput("gpu_milli", f"at most {MILLI_PER_DEVICE} per device, got {self.gpu_milli}")
        if self.gpu_count == 0 and self.gpu_milli:
            raise InvalidInput("gpu_milli", "given without any device (gpu_count is 0)")
        if self.gpu_count > 0 and self.gpu_milli == 0:
            raise InvalidInput("gpu_milli", "must be above 0 when devices are requested")
        if self.gpu_count > 1 and self.gpu_milli < MILLI_PER_DEVICE:
            raise InvalidInput(
                "gpu_milli",
                f"a fraction of a device ({self.gpu_milli}m) is only allowed for a single device, "
                f"not {self.gpu_count}",
            )
        if self.gang_nodes > 1 and self.gpu_count > 0 and self.gpu_milli < MILLI_PER_DEVICE:
            raise InvalidInput("gpu_milli", "a gang over several nodes takes whole devices")
        if self.isolation is not None and not isinstance(self.isolation, Isolation):
            try:
                object.__setattr__(self, "isolation", Isolation(self.isolation))
            except ValueError:
                raise InvalidInput("isolation", f"unknown isolation {self.isolation!r}") from None
        object.__setattr__(self, "_tier", self._resolve_tier())
        whole = self.gpu_milli >= MILLI_PER_DEVICE or self.sharing == Sharing.EXCLUSIVE
        object.__setattr__(self, "_whole", whole or self._tier in (Isolation.EXCLUSIVE, Isolation.MIG))
        self._check_tier()
        if self.sharing == Sharing.EXCLUSIVE:
            if self.gpu_count == 0:
                raise InvalidInput("sharing", "exclusive needs at least one device")
            if self.gpu_milli != MILLI_PER_DEVICE and self.tier != Isolation.MIG:
                raise InvalidInput("sharing", "exclusive takes whole devices (gpu_milli must be 1000)")
        if self.colocate is not None and (not isinstance(self.colocate, str) or not self.colocate):
            raise InvalidInput("colocate", f"must be a node label key, got {self.colocate!r}")
        if self.models is not None:
            for m in self.models:
                if not _MODEL_NAME.match(m):
                    raise InvalidInput("models", f"bad model name {m!r}")
        if self.vendors is not None:
            for v in self.vendors:
                if not canonical(v) or v != canonical(v):
                    known = ", ".join(VENDORS)
                    raise InvalidInput("vendors", f"unknown vendor {v!r} (known: {known})")
        if isinstance(self.min_gpu_memory_mib, bool) or not isinstance(self.min_gpu_memory_mib, int):
            raise InvalidInput(
                "min_gpu_memory_mib", f"must be a whole number of MiB, got {self.min_gpu_memory_mib!r}"
            )
        if self.min_gpu_memory_mib < 0:
            raise InvalidInput("min_gpu_memory_mib", f"must not be negative, got {self.min_gpu_memory_mib}")
        for name, version in self.stacks:
            if not _STACK_NAME.match(str(name)) or version_key(str(version)) is None:
                raise InvalidInput("stacks", f"expected NAME-VERSION such as cuda-12.4, got {name}-{version}")
        if (self.vendors is not None or self.min_gpu_memory_mib) and self.gpu_count == 0:
            where = "vendors" if self.vendors is not None else "min_gpu_memory_mib"
            raise InvalidInput(where, "a device capability given without any device (gpu_count is 0)")

    def _check_tier(self) -> None:
        if self.mig_profile is not None:
            if not isinstance(self.mig_profile, str) or not MIG_PROFILE.match(self.mig_profile):
                raise InvalidInput(
                    "mig", f"bad MIG profile {self.mig_profile!r} (expected e.g. 1g.10gb, 3g.40gb)"
                )
            if self.isolation not in (None, Isolation.MIG):
                raise InvalidInput("isolation", f"{self.isolation} contradicts mig={self.mig_profile!r}")
        where = "mig" if self.mig_profile is not None else "isolation"
        if self.tier == Isolation.MIG and self.gpu_count != 1:
            raise InvalidInput(where, f"a MIG instance is one device: ask for 1, not {self.gpu_count}")
        if self.isolation == Isolation.MPS and self.gpu_count != 1:
            raise InvalidInput(
                "isolation",
                f"mps shares one device (one MPS server per GPU): ask for 1 device, not {self.gpu_count}",
            )
        if self.isolation == Isolation.EXCLUSIVE and self.gpu_count and self.gpu_milli < MILLI_PER_DEVICE:
            raise InvalidInput("isolation", "exclusive takes whole devices (gpu_milli must be 1000)")

    def _resolve_tier(self) -> Isolation | None:
        if self.mig_profile is not None:
            return Isolation.MIG
        if self.gpu_count == 0:
            return None
        if self.isolation is not None:
            return self.isolation
        if self.sharing == Sharing.EXCLUSIVE or self.gpu_milli >= MILLI_PER_DEVICE:
            return Isolation.EXCLUSIVE
        return Isolation.TIMESLICE

    @property
    def tier(self) -> Isolation | None:
        """The isolation tier of this request's slices (None for CPU-only work)."""
        return self._tier

    @property
    def whole_devices(self) -> bool:
        """Takes each device whole (all its compute and memory) rather than a share of it."""
        return self._whole

    @property
    def fractional(self) -> bool:
        """A share of one device (a MIG instance is taken whole, whatever share it asks for)."""
        return self.gpu_count == 1 and not self._whole

    @property
    def total_gpu_milli(self) -> int:
        return self.gpu_count * self.gpu_milli * self.gang_nodes

    def kind_key(self) -> tuple:
        """Requests with equal keys score alike on every node (used for score caching).

        Host memory is left out: no score depends on it, and the scheduler checks it per node.
        The tenant is in only for mps: a device's mps slices belong to one tenant at a time.
        """
        return (
            self.gpu_count,
            self.gpu_milli,
            self.gpu_memory_mib,
            self.cpu_milli,
            self.models,
            self.sharing,
            self.tier,
            self.mig_profile,
            self.tenant if self._tier == Isolation.MPS else "",
            self.vendors,
            self.min_gpu_memory_mib,
        )

    @property
    def node_rules_key(self) -> tuple[object, ...]:
        """What the node-level rules (constraints.py) read of a request, the tenant aside."""
        return (self.node_selector, self.tolerations, self.stacks)
