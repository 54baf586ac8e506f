"""`cpool run -f task.yaml`: a job described in a file, checked before anything is sent.

The file holds what `cpool run` takes, its resources under `resources:` (the keys of `cpool serve -f`'s
request: gpus, gpu_mem, cpus, mem, models, image, …). A pydantic model (extra keys refused) checks it,
each value through the same parser as its flag (client/options.py), and a refusal names the YAML line
and the field: `task.yaml:7: resources.gpus: …`. Flags typed on the command line win over the file.
A service spec's `resources:` section (serve_spec.py) is checked by the same `Resources` model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from computepool.client.options import build_request
from computepool.core.errors import InvalidInput
from computepool.core.quantities import parse_duration_s
from computepool.wire.allocations import parse_array

SHELL = "/bin/sh"
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_AFTER = re.compile(r"[0-9]+(:(ok|any|failed))?")
Scalar = str | int | float


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class Resources(_Strict):
    """What one job asks for, per node, in the flags' units (`gpus: 0.5`, `mem: 8GiB`)."""

    gpus: Scalar = 0
    gpu_mem: Scalar | None = Field(default=None, alias="gpu-mem")
    cpus: Scalar = 0
    mem: Scalar = 0
    models: list[str] | None = None
    image: str | None = None
    exclusive: bool = False
    isolation: str | None = None

    @field_validator("gpus", "gpu_mem", "cpus", "mem")
    @classmethod
    def _quantity(cls, v: Scalar | None, info: ValidationInfo) -> Scalar | None:
        if isinstance(v, int | float) and not isinstance(v, bool) and v < 0:
            raise ValueError("must be ≥ 0")
        if v is not None:  # the flag's own parser, so the file and `--gpus` mean the same
            try:
                one: dict[str, Any] = {str(info.field_name): v}
                build_request(flag="", **one)
            except InvalidInput as e:
                raise ValueError(e.message) from None
        return v


class TaskFile(_Strict):
    """A task file: `command` as a list (run as given) or a string (run by `sh -c`)."""

    name: str | None = None
    command: list[Scalar] | str | None = None
    resources: Resources = Field(default_factory=Resources)
    env: dict[str, Scalar] | None = None
    secrets: list[str] | None = None
    code: str | None = None  # the directory shipped with the job, relative to the file
    no_code: bool = Field(default=False, alias="no-code")
    array: str | None = None
    after: list[str | int] | None = None
    retries: int = Field(default=0, ge=0, le=20)
    retry_on_exit: list[int] | None = Field(default=None, alias="retry-on-exit")
    time_limit: Scalar | None = Field(default=None, alias="time-limit")
    priority: int = 0
    restartable: bool = False

    @field_validator("time_limit")
    @classmethod
    def _duration(cls, v: Scalar | None) -> Scalar | None:
        if v is not None:
            try:
                parse_duration_s(v, "time_limit")
            except InvalidInput as e:
                raise ValueError(e.message) from None
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, Scalar] | None) -> dict[str, Scalar] | None:
        for key in v or {}:
            if not _ENV_KEY.fullmatch(key):
                raise ValueError(f"{key!r} is not a variable name (letters, digits, '_'; not first a digit)")
        return v

    @field_validator("array")
    @classmethod
    def _array(cls, v: str | None) -> str | None:
        if v is not None:
            parse_array(v)  # its ValueError reads as the field's message
        return v

    @field_validator("after")
    @classmethod
    def _after(cls, v: list[str | int] | None) -> list[str | int] | None:
        for item in v or []:
            if not _AFTER.fullmatch(str(item)):
                raise ValueError(f"{item!r}: give ID, ID:ok, ID:any or ID:failed")
        return v

    @field_validator("retry_on_exit")
    @classmethod
    def _codes(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and not all(1 <= c <= 255 for c in v):
            raise ValueError(f"{v!r}: exit codes are 1..255")
        return v

    @field_validator("command")
    @classmethod
    def _command(cls, v: list[Scalar] | str | None) -> list[Scalar] | str | None:
        if v is not None and not (v.strip() if isinstance(v, str) else v):
            raise ValueError("empty: give a command line or a list of words")
        return v


@dataclass(frozen=True)
class LoadedTask:
    """A checked task file and where it stands (relative paths in it are from its directory)."""

    path: Path
    task: TaskFile

    def command(self) -> list[str] | None:
        c = self.task.command
        if isinstance(c, str):
            return [SHELL, "-c", c.strip()]
        return [str(w) for w in c] if c else None

    def workdir(self) -> Path | None:
        if self.task.code is None:
            return None
        p = Path(self.task.code).expanduser()
        return p if p.is_absolute() else self.path.parent / p

    def env_pairs(self) -> list[str]:
        return [f"{k}={v}" for k, v in (self.task.env or {}).items()]

    def after(self) -> list[str] | None:
        return [str(a) for a in self.task.after] if self.task.after else None


def _lines(node: Any, prefix: tuple[str | int, ...], out: dict[tuple[str | int, ...], int]) -> None:
    """Each key's (and list item's) line, by its path in the document."""
    import yaml

    out[prefix] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            key = str(k.value)
            _lines(v, (*prefix, key), out)
            out[(*prefix, key)] = out[(*prefix, key.replace("-", "_"))] = k.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _lines(item, (*prefix, i), out)


def load_task(path: Path) -> LoadedTask:
    """Read and check a task file; every refusal is `FILE:LINE: FIELD: what is wrong`."""
    import yaml  # loaded by the command that reads a task file

    try:
        text = path.expanduser().read_text()
    except OSError as e:
        raise InvalidInput("--file", f"cannot read {path}: {e.strerror or e}") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise InvalidInput(f"{path}{line}", f"not valid YAML: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise InvalidInput(f"{path}:1", "expected a mapping (command: …, resources: {gpus: 1}, …)")
    lines: dict[tuple[str | int, ...], int] = {}
    if node is not None:
        _lines(node, (), lines)
    try:
        return LoadedTask(path, TaskFile.model_validate(data))
    except ValidationError as e:
        raise _refusal(path, e, lines) from None


def _refusal(
    path: Path, e: ValidationError, lines: dict[tuple[str | int, ...], int], prefix: tuple[str, ...] = ()
) -> InvalidInput:
    """The first error as `FILE:LINE: dotted.field`, the line the field's key stands on."""
    err = e.errors()[0]
    loc = (*prefix, *err["loc"])
    # a union reports its member's name last (`str`, `list[str]`): keep what the file wrote
    while loc and loc not in lines:
        loc = loc[:-1]
    dotted = ".".join(str(p) for p in (loc or (*prefix, *err["loc"])[:1]))
    message = str(err["msg"]).removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        message = "unknown key"
    return InvalidInput(f"{path}:{lines.get(loc, 1)}: {dotted}", message)


# `resources:` keys → the flat keys a service spec (serve_spec.FILE_KEYS) reads them by.
SPEC_KEYS = {"gpus": "gpus", "gpu_mem": "gpu_mem", "cpus": "cpus", "mem": "mem", "models": "model"} | {
    "image": "image",
    "exclusive": "exclusive",
    "isolation": "isolation",
}


def spec_resources(path: Path, node: Any, data: Any) -> tuple[dict[str, Any], dict[str, int]]:
    """A service spec's `resources:` section, checked by the task file's `Resources`: its values by
    the spec's flat keys, and the line each stands on."""
    lines: dict[tuple[str | int, ...], int] = {}
    if node is not None:
        _lines(node, ("resources",), lines)
    try:
        res = Resources.model_validate({} if data is None else data)
    except ValidationError as e:
        raise _refusal(path, e, lines, ("resources",)) from None
    values = {SPEC_KEYS[k]: getattr(res, k) for k in res.model_fields_set}
    where = {
        SPEC_KEYS[k]: lines.get(("resources", k), lines.get(("resources",), 1)) for k in res.model_fields_set
    }
    return values, where


def _text(v: Scalar | None) -> str | None:
    return None if v is None else str(v)


def typed_options(ctx: Any) -> set[str]:
    """The parameters of a click context given on the command line or by a variable, not defaulted."""
    out = set()
    for p in ctx.params:
        source = ctx.get_parameter_source(p)  # typer may bring its own click: compare by name
        if source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP"):
            out.add(p)
    return out


def file_options(loaded: LoadedTask, given: set[str]) -> dict[str, Any]:
    """`cpool run`'s parameters as the file sets them, leaving out those typed on the command line
    (`given`) and those the file leaves out (their flag's default stands)."""
    t, r = loaded.task, loaded.task.resources
    from_resources: dict[str, tuple[str, Any]] = {
        "gpus": ("gpus", str(r.gpus)),
        "gpu_mem": ("gpu_mem", _text(r.gpu_mem)),
        "cpus": ("cpus", str(r.cpus)),
        "mem": ("mem", str(r.mem)),
        "models": ("model", r.models),
        "image": ("image", r.image),
        "exclusive": ("exclusive", r.exclusive),
        "isolation": ("isolation", r.isolation),
    }
    from_task: dict[str, tuple[str, Any]] = {
        "time_limit": ("time_limit", _text(t.time_limit)),
        "restartable": ("restartable", t.restartable),
        "array": ("array", t.array),
        "after": ("after", loaded.after()),
        "retries": ("retries", t.retries),
        "retry_on_exit": ("retry_on_exit", ",".join(map(str, t.retry_on_exit or [])) or None),
        "name": ("name", t.name),
        "priority": ("priority", t.priority),
        "code": ("workdir", loaded.workdir()),
        "no_code": ("no_code", t.no_code),
        "secrets": ("secret", t.secrets),
    }
    out: dict[str, Any] = {}
    for fields, fields_set in ((from_resources, r.model_fields_set), (from_task, t.model_fields_set)):
        for key, (param, value) in fields.items():
            if key in fields_set and param not in given:
                out[param] = value
    return out
