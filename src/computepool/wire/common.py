"""Shared field types and bounds. Bounds reject absurd values at the edge, naming the field."""

from __future__ import annotations

from typing import Annotated, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

T = TypeVar("T")

MAX_CPU_MILLI = 10**9  # a million cores
MAX_MEMORY_MIB = 2**40  # an exbibyte
MAX_GPU_MILLI = 10**10  # ten million devices
MAX_EXPIRES_S = 10 * 366 * 24 * 3600
MAX_ID = 2**63 - 1  # the largest BIGINT (SQLite and PostgreSQL): a larger id names nothing stored

Name = Annotated[
    str,
    StringConstraints(pattern=r"^[a-z0-9][a-z0-9_.-]{0,62}$"),
    Field(description="Lower-case letters, digits, '.', '_' or '-'; at most 63 characters."),
]
ModelName = Annotated[
    str,
    StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"),
    Field(description="A GPU model name as the agent reports it, e.g. A100-SXM4-80GB."),
]
Count = Annotated[int, Field(strict=True, ge=0)]
Id = Annotated[int, Field(strict=True, ge=1, le=MAX_ID, description="A stored object's id.")]


class In(BaseModel):
    """Base of request bodies: unknown fields are an error, not silently dropped."""

    # models are built at their first use, not at import: a CLI command builds the few it sends
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=False, defer_build=True)


class Out(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)


def build_all() -> None:
    """Build every wire model now (the server, at start: its first requests pay nothing, and the
    API document is made from built models); a client builds only those it uses, when it uses them."""
    todo: list[type[BaseModel]] = [In, Out]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        cls.model_config["defer_build"] = False  # what FastAPI makes from them is built at once too
        cls.model_rebuild()


class Items(Out, Generic[T]):
    items: list[T] = Field(description="The matching objects.")


MAX_TAINTS = 16
# `key` (any value of the taint) or `key=value` (that taint only), as Kubernetes' Exists / Equal;
# here, not in nodes.py, so that a request's model does not load every node model
Toleration = Annotated[
    str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_./-]{0,62}(=[A-Za-z0-9_.:/@ -]{0,63})?$")
]
