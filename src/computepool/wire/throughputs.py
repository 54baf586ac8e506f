"""Wire types of measured speeds (server/logic/throughputs.py; `cpool throughputs`)."""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from computepool.wire.common import Out


class ThroughputOut(Out):
    """One tenant's measured speed of one job type on `devices` devices of one model."""

    tenant: str
    job_type: str
    model: str = Field(description="The device model as nodes report it.")
    devices: int = Field(description="Devices the job held in all (per node × nodes).")
    steps_per_s: float = Field(description="Exponentially weighted mean of the reported steps/s.")
    samples: int = Field(description="Reports folded into the mean.")
    updated_at: datetime = Field(description="When the last report came.")
