"""Cooperative inference's wire types: a cooperative service's model and options (part of
`ServiceSpec`), and its plan as `cpool services explain` shows it."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import Field

from computepool.wire.common import In, Out

CoopStatus = Literal["measuring", "planned", "starting", "running", "replanning", "failed"]
ShardRole = Literal["head", "rpc"]
MODEL_KEY_PATTERN = r"^[A-Za-z0-9_.:-]{1,128}$"


class CoopSpec(In):
    """One model split over devices of several nodes by llama.cpp's RPC backend."""

    model: str = Field(
        min_length=2, max_length=4096, pattern=r"^/",
        description="Absolute path of the GGUF file on the nodes (readable by the service's tenant).",
    )  # fmt: skip
    model_key: str | None = Field(
        default=None, pattern=MODEL_KEY_PATTERN,
        description="Names the model's measurements (default: derived from the path); change it when "
        "the file changes.",
    )  # fmt: skip
    engine_python: str = Field(
        default="/opt/computepool/llama-venv/bin/python", min_length=2, max_length=4096, pattern=r"^/",
        description="Python with llama-cpp-python built with GGML_RPC=ON, on every node.",
    )  # fmt: skip
    ctx: int = Field(default=512, strict=True, ge=16, le=1 << 20, description="Context length.")
    max_nodes: int = Field(default=4, strict=True, ge=1, le=16, description="At most this many nodes.")
    min_gain: float = Field(
        default=1.1, ge=1.0, le=100.0,
        description="A split is chosen over the best single device only when predicted this much faster.",
    )  # fmt: skip
    force_split: int | None = Field(
        default=None, strict=True, ge=1, le=16,
        description="Benchmarks: run on exactly this many nodes (1: the fastest single device), whatever "
        "the measurements say.",
    )  # fmt: skip
    probe_tokens: int = Field(
        default=32, strict=True, ge=4, le=4096, description="Tokens each speed probe decodes."
    )


class CoopShardOut(Out):
    node: str
    device: str = Field(description='"cpu" or "gpu<index>".')
    role: ShardRole
    first_layer: int
    layers: int
    memory_mib: int
    tokens_per_s: float | None = Field(description="Measured for the whole model on this device alone.")
    endpoint: str | None = Field(description="The RPC server's ADDRESS:PORT (rpc shards, once placed).")


class CoopCandidateOut(Out):
    node: str
    device: str
    tokens_per_s: float | None
    memory_mib: int
    holds_model: bool
    measured_at: datetime | None
    note: str = Field(description="Why it is not used, when it is not (unmeasured, no link, …).")


class CoopLinkOut(Out):
    a: str
    b: str
    rtt_ms: float | None
    bandwidth_mbps: float | None


class CoopOptionOut(Out):
    """One placement the planner weighed."""

    shards: list[CoopShardOut]
    predicted_tokens_per_s: float
    note: str


class CoopPlanOut(Out):
    service: str
    status: CoopStatus
    reason: str = Field(description="Why this plan (or what the controller waits for).")
    attempt: int = Field(description="Plans made so far (each failure re-plans).")
    shards: list[CoopShardOut]
    predicted_tokens_per_s: float | None
    measured_tokens_per_s: float | None = Field(description="The running plan's measured decoding speed.")
    best_single: CoopShardOut | None = Field(description="The fastest single device that holds the model.")
    candidates: list[CoopCandidateOut]
    links: list[CoopLinkOut]
    options: list[CoopOptionOut]
    updated_at: datetime
