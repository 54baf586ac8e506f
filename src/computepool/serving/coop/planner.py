"""Where a cooperative service's model runs: one device, or contiguous layer ranges over several nodes.

Pure and deterministic: measurements in, a plan out (the coop controller gathers the measurements,
`cpool services explain` shows the plan and its reason).

Cost model, in seconds per generated token (decoding one stream is a pipeline: the shards work one
after another, never at once):

    Σ over shards  (layers_i / n_layers) / tokens_per_s_i       each device's measured whole-model speed
  + Σ over RPC shards  k × rtt + bytes / bandwidth + overhead   each hop between the head and a shard

- k = ROUND_TRIPS_PER_HOP = 1. llama.cpp's RPC client sends a shard its inputs and graph without
  waiting, then reads the result back once: counted with a relay between head.py and rpc_server.py on
  this VM (tiny model), 100 more tokens made exactly 100 more request→answer turns on the connection,
  whether the shard held the output layer alone or 1 or 2 layers with it.
- bytes: the same relay saw 1.5-4.6 KB sent per token (inputs and the serialized graph: HOP_BYTES)
  and 4 × n_vocab + 8 back (the logits: llama.cpp puts the output layer on the last RPC shard), plus
  the activations, 4 × n_embd each way.
- overhead: a hop also costs the shard's process a wake-up and a graph launch whatever the link.
  On this (busy, 2-core) VM, tiny model, 200 tokens, medians of 7 probes: one process alone
  0.35-0.46 ms/token (2,200-2,800 tokens/s); the forced two-node split (layer 1 and the output on an
  RPC server) 1.05-1.09 ms/token (915-950 tokens/s) over loopback and over a veth pair alike (rtt
  0.05-0.3 ms), 0.6 ms of overhead per hop, with llama.cpp's RPC reached directly. Since every
  connection between nodes goes through the authenticated relay (engine/relay.py: a Python thread
  pumps each direction), a hop costs more: probes 1.5-1.7 ms/token split against 0.15-0.36 alone
  (1.3 ms more), and through the gateway (`cpool bench coop`, 2 runs) 2.8-2.9 ms against
  0.6-0.8 (2.1 ms more). HOP_OVERHEAD_S = 1.5 ms sits between the two.

Because the shards run one after another, a split's compute time is a speed-weighted average of its
devices' and can never beat the fastest device alone: a split pays off only when no single device
holds the model (or measured speeds were taken under memory pressure, which `min_gain` guards).
Layers therefore go to the fastest devices first, as many as their memory takes, at least one per
shard; the head keeps the first layers and the input embeddings, the last RPC shard the output layer.

Memory: a shard needs (layers × layer_bytes + its part of the embeddings/output) × MEMORY_MARGIN
(the margin covers the KV cache and compute buffers); a single device needs model_bytes × margin.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

ROUND_TRIPS_PER_HOP = 1
HOP_BYTES = 4096
HOP_OVERHEAD_S = 0.0015
MEMORY_MARGIN = 1.15
MAX_REMOTES = 8  # more usable remote devices than this: the fastest and the roomiest are weighed
MIB = 1 << 20

Role = Literal["head", "rpc"]


@dataclass(frozen=True)
class Candidate:
    """A device that could run shards: its memory and its measured whole-model decoding speed."""

    node: str
    device: str
    memory_mib: int
    tokens_per_s: float | None  # None: not measured, not usable


@dataclass(frozen=True)
class Link:
    """The measured link between two nodes (either direction)."""

    a: str
    b: str
    rtt_ms: float | None
    bandwidth_mbps: float | None


@dataclass(frozen=True)
class ModelShape:
    n_layers: int
    model_bytes: int
    layer_bytes: int  # one repeating layer
    embd_bytes: int  # input embeddings + output layer: half on the head, half on the last RPC shard
    n_embd: int = 0  # activations' width (0: unknown, left out of the hop's bytes)
    n_vocab: int = 0  # logits' width (0: unknown, left out of the hop's bytes)


@dataclass(frozen=True)
class Shard:
    node: str
    device: str
    role: Role
    first_layer: int
    layers: int
    memory_mib: int
    tokens_per_s: float | None


@dataclass(frozen=True)
class Option:
    shards: tuple[Shard, ...]
    predicted_tokens_per_s: float
    note: str


@dataclass(frozen=True)
class Plan:
    chosen: Option | None
    best_single: Option | None
    options: tuple[Option, ...]
    reason: str


def _name(c: Candidate) -> str:
    return f"{c.node}/{c.device}"


Links = dict[frozenset[str], Link]


def _usable_links(links: Iterable[Link]) -> Links:
    """The measured links by their pair of nodes (a pair without rtt and bandwidth is not usable)."""
    usable: Links = {}
    for k in links:
        if k.rtt_ms is not None and k.rtt_ms >= 0 and (k.bandwidth_mbps or 0) > 0:
            usable.setdefault(frozenset((k.a, k.b)), k)
    return usable


def hop_seconds(model: ModelShape, link: Link, last: bool) -> float:
    """One token's cost of one hop between the head and an RPC shard (see the module's docstring)."""
    assert link.rtt_ms is not None and link.bandwidth_mbps
    sent = HOP_BYTES + 2 * 4 * model.n_embd + (4 * model.n_vocab if last else 0)
    return ROUND_TRIPS_PER_HOP * link.rtt_ms / 1000 + sent * 8 / (link.bandwidth_mbps * 1e6) + HOP_OVERHEAD_S


def _single(model: ModelShape, c: Candidate) -> Option | None:
    need = model.model_bytes * MEMORY_MARGIN
    if c.tokens_per_s is None or c.tokens_per_s <= 0 or need > c.memory_mib * MIB:
        return None
    shard = Shard(c.node, c.device, "head", 0, model.n_layers, max(1, math.ceil(need / MIB)), c.tokens_per_s)
    return Option((shard,), c.tokens_per_s, f"{_name(c)} alone")


def _split(model: ModelShape, head: Candidate, remotes: Sequence[Candidate], links: Links) -> Option | None:
    """The best layer split with `head` first and `remotes` as RPC shards, or None if it cannot fit."""
    n = model.n_layers
    order = [head, *sorted(remotes, key=lambda c: (-(c.tokens_per_s or 0), c.node, c.device))]
    if len(order) > n:
        return None
    half_embd = model.embd_bytes / 2
    fixed = [half_embd] + [0.0] * (len(order) - 2) + [half_embd]
    caps = []
    for c, f in zip(order, fixed, strict=True):
        room = c.memory_mib * MIB / MEMORY_MARGIN - f
        caps.append(n if model.layer_bytes <= 0 else int(room // model.layer_bytes))
    if min(caps) < 1:
        return None
    layers = [1] * len(order)
    left = n - len(order)
    for i in sorted(range(len(order)), key=lambda i: -(order[i].tokens_per_s or 0)):  # fastest first
        more = min(left, caps[i] - 1)
        layers[i] += more
        left -= more
    if left > 0:
        return None
    seconds = sum(k / n / (c.tokens_per_s or 1) for c, k in zip(order, layers, strict=True))
    hops = []
    for i, c in enumerate(order[1:], start=1):
        link = links[frozenset((head.node, c.node))]
        seconds += hop_seconds(model, link, last=i == len(order) - 1)
        hops.append(f"{c.node} {link.rtt_ms:g} ms")
    shards, first = [], 0
    for i, (c, k, f) in enumerate(zip(order, layers, fixed, strict=True)):
        mib = max(1, math.ceil((k * model.layer_bytes + f) * MEMORY_MARGIN / MIB))
        shards.append(Shard(c.node, c.device, "head" if i == 0 else "rpc", first, k, mib, c.tokens_per_s))
        first += k
    ranges = ", ".join(f"{_name(c)} layers {s.first_layer}-{s.first_layer + s.layers - 1}"
                       for c, s in zip(order, shards, strict=True))  # fmt: skip
    return Option(tuple(shards), 1 / seconds, f"{len(order)} nodes: {ranges} (links from {head.node}: "
                  f"{', '.join(hops)})")  # fmt: skip


def _remote_pool(remotes: list[Candidate]) -> list[Candidate]:
    """At most MAX_REMOTES of the usable remote devices: the fastest and the roomiest halves."""
    if len(remotes) <= MAX_REMOTES:
        return remotes
    fast = sorted(remotes, key=lambda c: (-(c.tokens_per_s or 0), c.node, c.device))
    roomy = sorted(remotes, key=lambda c: (-c.memory_mib, c.node, c.device))
    picked: list[Candidate] = []
    for c in itertools.chain.from_iterable(zip(fast, roomy, strict=True)):
        if c not in picked:
            picked.append(c)
        if len(picked) == MAX_REMOTES:
            break
    return picked


def _splits(model: ModelShape, candidates: Sequence[Candidate], links: Links, size: int,
            head_node: str | None) -> list[Option]:  # fmt: skip
    """Every split over exactly `size` nodes that fits."""
    found: list[Option] = []
    measured = [c for c in candidates if c.tokens_per_s is not None and c.tokens_per_s > 0]
    for head in measured:
        if head_node is not None and head.node != head_node:
            continue
        linked = [c for c in measured if c.node != head.node and frozenset((head.node, c.node)) in links]
        remotes = _remote_pool(linked)
        for combo in itertools.combinations(remotes, size - 1):
            if len({c.node for c in combo}) < size - 1:
                continue  # one shard per node: a node runs one RPC server
            got = _split(model, head, combo, links)
            if got:
                found.append(got)
    return found


def _fastest(options: Iterable[Option]) -> Option | None:
    return min(options, key=lambda o: (-o.predicted_tokens_per_s, o.note), default=None)


def _tps(o: Option) -> str:
    return f"predicted {o.predicted_tokens_per_s:.1f} tokens/s"


def plan(
    model: ModelShape,
    candidates: Sequence[Candidate],
    links: Sequence[Link],
    *,
    max_nodes: int,
    min_gain: float,
    force_split: int | None = None,
    head_node: str | None = None,
) -> Plan:
    """Choose where the model runs. The fastest single device that holds it wins unless a split is
    predicted at least `min_gain` times faster; a split is chosen when no single device holds the
    model; `force_split=N` takes the best N-node option (1: the best single device) whatever the
    speeds. With `head_node`, every option's head (and single device) is on that node, while
    `best_single` stays the fastest over all nodes: a plan there that would lose to it chooses nothing."""
    if model.n_layers < 1 or max_nodes < 1 or min_gain < 1:
        raise ValueError("n_layers and max_nodes must be at least 1, min_gain at least 1")
    singles = sorted((o for c in candidates if (o := _single(model, c))),
                     key=lambda o: (-o.predicted_tokens_per_s, o.note))  # fmt: skip
    best_single = singles[0] if singles else None
    own = [o for o in singles if head_node is None or o.shards[0].node == head_node]
    top = max(max_nodes, force_split or 1)
    usable = _usable_links(links)
    by_size = {n: _fastest(_splits(model, candidates, usable, n, head_node)) for n in range(2, top + 1)}
    splits = sorted((o for o in by_size.values() if o), key=lambda o: (-o.predicted_tokens_per_s, o.note))
    options = tuple(own + splits)
    chosen, reason = _choose(model, best_single, own, splits, by_size, min_gain, force_split, head_node)
    return Plan(chosen, best_single, options, reason)


def _choose(model: ModelShape, best_single: Option | None, own: list[Option], splits: list[Option],
            by_size: dict[int, Option | None], min_gain: float, force: int | None,
            head_node: str | None) -> tuple[Option | None, str]:  # fmt: skip
    where = f" with the head on {head_node}" if head_node else ""
    if force == 1:
        if not own:
            return None, f"forced onto one device{where}, but none holds the model ({_needs(model)})"
        return own[0], f"forced onto one device: {own[0].note}, {_tps(own[0])}"
    if force is not None:
        got = by_size.get(force)
        if got is None:
            return None, (f"forced over {force} nodes{where}, but no {force} measured nodes with "
                          "measured links hold the model together")  # fmt: skip
        versus = f" (alone, {best_single.note} would make {_tps(best_single)})" if best_single else ""
        return got, f"forced over {force} nodes: {got.note}, {_tps(got)}{versus}"
    split = splits[0] if splits else None
    if best_single is None:
        if split is None:
            return None, (f"no single device holds the model ({_needs(model)}) and no split fits: not enough "
                          f"measured nodes{where} with measured links and memory")  # fmt: skip
        return split, f"no single device holds the model ({_needs(model)}): {split.note}, {_tps(split)}"
    if split and split.predicted_tokens_per_s >= min_gain * best_single.predicted_tokens_per_s:
        return split, (f"{split.note}, {_tps(split)}: at least {min_gain:g}x the fastest single "
                       f"device ({best_single.note}, {_tps(best_single)})")  # fmt: skip
    if own and own[0] is best_single:
        lose = f"; the best split would make {_tps(split)}" if split else ""
        why = f"{best_single.note} holds the model and is the fastest device: {_tps(best_single)}{lose}"
        return best_single, why
    return None, (f"the fastest single device is {best_single.note} ({_tps(best_single)}), not on "
                  f"{head_node}: no plan with the head here is as fast")  # fmt: skip


def _needs(model: ModelShape) -> str:
    return f"it needs {math.ceil(model.model_bytes * MEMORY_MARGIN / MIB)} MiB"


def layer_params(shards: Sequence[Shard]) -> tuple[int, list[float]]:
    """head.py's --n-gpu-layers and --tensor-split for a plan's shards (head first, then RPC shards in
    --rpc order). llama.cpp offloads the last K of its n_layer+1 layers (the output layer counts as
    the last) and divides them among the RPC devices by the split's proportions, so K is the RPC
    shards' layers plus one and the last RPC shard's part counts the output layer too."""
    rpc = [s.layers for s in shards if s.role == "rpc"]
    if not rpc:
        return 0, []
    rpc[-1] += 1
    return sum(rpc), [float(x) for x in rpc]
