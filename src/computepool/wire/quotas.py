"""Tenant quotas: a `{guaranteed, limit}` pair per resource, pool-wide and per GPU model."""

from __future__ import annotations

from pydantic import Field, model_validator

from computepool.wire.common import MAX_CPU_MILLI, MAX_GPU_MILLI, MAX_MEMORY_MIB, In, ModelName

MAX_MODELS = 256


class _Pair(In):
    guaranteed: int
    limit: int

    @model_validator(mode="after")
    def _order(self) -> _Pair:
        if self.limit < self.guaranteed:
            raise ValueError(f"limit ({self.limit}) is below guaranteed ({self.guaranteed})")
        return self


class GpuMilliPair(_Pair):
    guaranteed: int = Field(strict=True, ge=0, le=MAX_GPU_MILLI, description="Milli-GPUs promised.")
    limit: int = Field(
        strict=True, ge=0, le=MAX_GPU_MILLI, description="Most milli-GPUs the tenant may hold."
    )


class MemoryMibPair(_Pair):
    guaranteed: int = Field(strict=True, ge=0, le=MAX_MEMORY_MIB, description="MiB promised.")
    limit: int = Field(strict=True, ge=0, le=MAX_MEMORY_MIB, description="Most MiB the tenant may hold.")


class CpuMilliPair(_Pair):
    guaranteed: int = Field(strict=True, ge=0, le=MAX_CPU_MILLI, description="Millicores promised.")
    limit: int = Field(
        strict=True, ge=0, le=MAX_CPU_MILLI, description="Most millicores the tenant may hold."
    )


class ModelQuota(In):
    gpu_milli: GpuMilliPair | None = Field(default=None, description="Milli-GPUs of this model.")
    gpu_memory_mib: MemoryMibPair | None = Field(default=None, description="GPU memory of this model.")


class Quota(In):
    """Resources left out have no quota: nothing guaranteed, no limit but the pool."""

    gpu_milli: GpuMilliPair | None = Field(default=None, description="Milli-GPUs (1000 = one device).")
    gpu_memory_mib: MemoryMibPair | None = Field(default=None, description="GPU memory in MiB.")
    cpu_milli: CpuMilliPair | None = Field(default=None, description="Host CPU in millicores.")
    memory_mib: MemoryMibPair | None = Field(default=None, description="Host memory in MiB.")
    models: dict[ModelName, ModelQuota] = Field(
        default_factory=dict, max_length=MAX_MODELS, description="Per GPU model quotas."
    )


POOL_RESOURCES = ("gpu_milli", "gpu_memory_mib", "cpu_milli", "memory_mib")
MODEL_RESOURCES = ("gpu_milli", "gpu_memory_mib")
