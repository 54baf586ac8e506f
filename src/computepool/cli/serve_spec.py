"""What `cpool serve` sends: a service spec from a YAML file and the command line, flags winning.

A spec file holds the long option names as keys (`-` or `_`): `name`, `command`, `port_env`,
`gpus`, `min`, `max`, `target_inflight`, …. Every value, wherever it came from, is read by the
same code as the flag (client/options.py for the request), and a refusal names where the value
came from: `--gpus` for a flag, `serve.yaml:4 gpus` for a line of the file.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from computepool.cli.secrets_cmd import secret_uses
from computepool.client.options import build_request
from computepool.core.errors import InvalidInput
from computepool.core.quantities import parse_duration_s

if TYPE_CHECKING:  # the wire's models load pydantic: not at the CLI's start-up
    from computepool.wire.allocations import AllocationCreate

# File key → the option's parameter name in `cpool serve` (Python cannot name a parameter `min`).
FILE_KEYS: dict[str, str] = {
    **{
        k: k
        for k in (
            "name",
            "command",
            "port_env",
            "gpus",
            "gpu_mem",
            "cpus",
            "mem",
            "exclusive",
            "model",
            "isolation",
            "image",
            "mig",
            "node_selector",
            "toleration",
            "priority",
            "env",
            "env_file",
            "secret",
            "workdir",
            "no_code",
            "target_inflight",
            "max_inflight",
            "health_path",
            "startup_grace",
            "idle",
            "scale_down_delay",
            "drain",
            "queue_timeout",
            "tenant",
            "cooperative",
            "engine_python",
            "max_nodes",
            "min_gain",
            "force_split",
        )
    },  # fmt: skip
    "min": "min_",
    "max": "max_",
    "ctx": "ctx_len",
}
# Spec fields given in seconds, from durations people write (`5m`); the flag, and whether 0 is allowed.
DURATIONS: dict[str, tuple[str, bool]] = {
    "startup_grace": ("startup_grace_s", False),
    "idle": ("idle_s", False),
    "scale_down_delay": ("scale_down_delay_s", True),
    "drain": ("drain_s", True),
    "queue_timeout": ("queue_timeout_s", False),
}
COUNTS: dict[str, str] = {
    "min": "min_replicas",
    "max": "max_replicas",
    "target_inflight": "target_inflight",
    "max_inflight": "max_inflight",
}


@dataclass(frozen=True)
class SpecFile:
    """A spec file's values by key (`-` read as `_`) and the line each key stands on."""

    path: Path
    values: dict[str, Any]
    lines: dict[str, int]

    def where(self, key: str) -> str:
        return f"{self.path}:{self.lines.get(key, 1)} {key}"

    def resolve(self, value: str) -> Path:
        """A path written in the file, relative to the file's own directory."""
        p = Path(value).expanduser()
        return p if p.is_absolute() else self.path.parent / p


def load_spec_file(path: Path) -> SpecFile:
    """Read SPEC.yaml: a mapping of known keys. Syntax errors name the file and line."""
    import yaml  # loaded by the command that reads a spec file

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
    if not isinstance(data, dict) or not isinstance(node, yaml.MappingNode | type(None)):
        raise InvalidInput(str(path), "expected a mapping of option names to values (name: my-model, …)")
    lines: dict[str, int] = {}
    for key_node, _ in node.value if node is not None else []:
        lines[str(key_node.value).replace("-", "_")] = key_node.start_mark.line + 1
    values: dict[str, Any] = {}
    for raw, value in data.items():
        key = str(raw).replace("-", "_")
        if key == "resources":  # the task file's section (cli/task_file.py), read as the flat keys
            from computepool.cli.task_file import spec_resources

            res_node = next((v for k, v in node.value if k.value == raw), None) if node is not None else None
            flat, flat_lines = spec_resources(path, res_node, value)
            for k, v in flat.items():
                if k in data or k.replace("_", "-") in data:
                    raise InvalidInput(f"{path}:{flat_lines[k]}", f"{k!r} given twice (here and at the top)")
                values[k], lines[k] = v, flat_lines[k]
            continue
        if key not in FILE_KEYS:
            known = ", ".join(sorted(FILE_KEYS))
            raise InvalidInput(f"{path}:{lines.get(key, 1)}", f"unknown key {raw!r} (known keys: {known})")
        if key in values:
            raise InvalidInput(f"{path}:{lines.get(key, 1)}", f"{raw!r} given twice")
        values[key] = value
    return SpecFile(path, values, lines)


@dataclass
class Sources:
    """The value of each option: the command line's when given there, else the file's, else the
    flag's default."""

    given: dict[str, Any]  # by file key: the flags typed on the command line
    defaults: dict[str, Any]
    file: SpecFile | None = None

    def has(self, key: str) -> bool:
        return key in self.given or (self.file is not None and key in self.file.values)

    def get(self, key: str) -> Any:
        if key in self.given:
            return self.given[key]
        if self.file is not None and key in self.file.values:
            return self.file.values[key]
        return self.defaults.get(key)

    def from_file(self, key: str) -> bool:
        return key not in self.given and self.file is not None and key in self.file.values

    def where(self, key: str) -> str:
        if self.from_file(key) and self.file is not None:
            return self.file.where(key)
        return "--" + key.replace("_", "-")

    def path(self, key: str) -> Path | None:
        value = self.get(key)
        if value is None:
            return None
        if self.from_file(key) and self.file is not None:
            if not isinstance(value, str):
                raise InvalidInput(self.where(key), f"expected a path, got {value!r}")
            return self.file.resolve(value)
        return Path(value)


@dataclass
class ServiceDraft:
    """A service before its code is shipped: the replica's request and the other spec fields."""

    name: str
    tenant: str | None
    request: AllocationCreate
    fields: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)
    workdir: Path | None = None
    no_code: bool = False
    env_file: Path | None = None  # not shipped with the code

    def spec(self, request: AllocationCreate) -> dict[str, Any]:
        """The ServiceSpec body, with `request` as shipped (code and env added)."""
        return {"request": request.body(), **self.fields}


def _count(src: Sources, key: str) -> int:
    value = src.get(key)
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(src.where(key), f"expected a whole number, got {value!r}")
    return value


def _flag(src: Sources, key: str) -> bool:
    value = src.get(key)
    if value is None or isinstance(value, bool):
        return bool(value)
    raise InvalidInput(src.where(key), f"expected true or false, got {value!r}")


def _seconds(src: Sources, key: str, zero_ok: bool) -> int:
    value = src.get(key)
    if zero_ok and (value == 0 or (isinstance(value, str) and value.strip() in ("0", "0s"))):
        return 0
    return parse_duration_s(value, src.where(key))


def _text(src: Sources, key: str) -> str | None:
    value = src.get(key)
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool) and key in ("gpus", "cpus", "mem"):
        return str(value)
    raise InvalidInput(src.where(key), f"expected text, got {value!r}")


def _words(src: Sources, key: str) -> list[str] | None:
    """A list option: one value or a list of them (a file may write either)."""
    value = src.get(key)
    if value is None:
        return None
    items = list(value) if isinstance(value, list | tuple) else [value]
    if not all(isinstance(v, str | int | float) and not isinstance(v, bool) for v in items):
        raise InvalidInput(src.where(key), f"expected text or a list of text, got {value!r}")
    return [str(v) for v in items] or None


def _pairs(src: Sources, key: str) -> list[str] | None:
    """KEY=VALUE items: a list of them, or (in a file) a mapping."""
    value = src.get(key)
    if isinstance(value, Mapping):
        return [f"{k}={'' if v is None else v}" for k, v in value.items()]
    return _words(src, key)


SHELL = "/bin/sh"


def command_of(src: Sources, extra: list[str]) -> list[str]:
    """The engine's command. Text (`--command '…'`, or the file's `command` as a string) runs
    through `/bin/sh -c`, so `--port $PORT` takes the replica's port as users expect; a list (the
    words after `--`, or the file's `command` as a list) runs as given, with no shell."""
    if extra and "command" in src.given:
        raise InvalidInput("--command", "give the command once: --command '…' or after `--`, not both")
    if extra:
        return list(extra)
    value = src.get("command")
    if isinstance(value, list) and value and all(isinstance(v, str | int | float) for v in value):
        return [str(v) for v in value]
    if isinstance(value, str) and value.strip():
        try:  # the shell would refuse it only once the replica starts: say so now
            shlex.split(value)
        except ValueError as e:
            raise InvalidInput(src.where("command"), f"cannot split {value!r}: {e}") from None
        return [SHELL, "-c", value.strip()]
    if value is None or value == "" or value == []:
        raise InvalidInput(
            "--command",
            "a service needs the command that starts its engine: --command '…', words after `--`, "
            "or `command:` in the spec file",
        )
    raise InvalidInput(src.where("command"), f"expected a command line or a list of words, got {value!r}")


def _file_named(src: Sources, build: Callable[[], AllocationCreate]) -> AllocationCreate:
    """Run `build`; a refusal of a value that came from the file names the file's line instead."""
    try:
        return build()
    except InvalidInput as e:
        key = e.where.removeprefix("--").replace("-", "_")
        if e.where.startswith("--") and src.from_file(key):
            raise InvalidInput(src.where(key), e.message) from None
        raise


def _environment(src: Sources) -> dict[str, str]:
    """`env_file` lines, then the file's `env`, then `--env` flags: each wins over the one before."""
    from computepool.cli.ship import parse_env  # loaded by the command that ships

    env = parse_env(None, src.path("env_file")) or {}
    if src.file is not None and "env" in src.file.values:
        try:
            env.update(parse_env(_pairs(Sources({}, {}, src.file), "env"), None) or {})
        except InvalidInput as e:
            raise InvalidInput(src.file.where("env"), e.message) from None
    env.update(parse_env(_pairs(Sources(src.given, {}), "env"), None) or {})
    return env


def draft_service(name: str | None, src: Sources, extra: list[str]) -> ServiceDraft:
    """The service `cpool serve` describes, checked as far as the client can."""
    name = name or _text(src, "name")
    if not name:
        raise InvalidInput("NAME", "name the service: cpool serve NAME … (or `name:` in the spec file)")
    coop = cooperative_of(src, extra)
    command = None if coop is not None else command_of(src, extra)
    priority = _count(src, "priority") if src.get("priority") is not None else 0
    request = _file_named(
        src,
        lambda: build_request(
            gpus=_text(src, "gpus") or "0",
            gpu_mem=_text(src, "gpu_mem"),
            cpus=_text(src, "cpus") or "0",
            mem=_text(src, "mem") or "0",
            exclusive=_flag(src, "exclusive"),
            model=None if coop is not None else _words(src, "model"),
            isolation=_text(src, "isolation"),
            image=_text(src, "image"),
            mig=_text(src, "mig"),
            node_selector=_pairs(src, "node_selector"),
            tolerations=_words(src, "toleration"),
            priority=priority,
            command=command,
            secrets=secret_uses(_words(src, "secret")),
        ),
    )
    fields: dict[str, Any] = {}
    port_env = _text(src, "port_env")
    if port_env:
        fields["port_env"] = port_env
    for key, spec_key in COUNTS.items():
        if src.get(key) is not None:
            fields[spec_key] = _count(src, key)
    health = _text(src, "health_path")
    if health:
        fields["health_path"] = health
    for key, (spec_key, zero_ok) in DURATIONS.items():
        if src.get(key) is not None:
            fields[spec_key] = _seconds(src, key, zero_ok)
    if coop is not None:
        fields.update(cooperative=coop, min_replicas=1, max_replicas=1)
        fields.setdefault("health_path", "/health")  # the head's own, which waits for no generation
    return ServiceDraft(
        name=name,
        tenant=_text(src, "tenant"),
        request=request,
        fields=fields,
        env=_environment(src),
        workdir=src.path("workdir"),
        no_code=_flag(src, "no_code"),
        env_file=src.path("env_file"),
    )


def cooperative_of(src: Sources, extra: list[str]) -> dict[str, Any] | None:
    """With `--cooperative`: the CoopSpec (`--model` is then the GGUF file on the nodes, and the
    coop controller writes the engine's command); None without it."""
    if not _flag(src, "cooperative"):
        for key in ("engine_python", "ctx", "max_nodes", "min_gain", "force_split"):
            if src.get(key) is not None:
                raise InvalidInput(src.where(key), "only with --cooperative")
        return None
    if extra or src.get("command") is not None:
        raise InvalidInput(
            "--command", "a cooperative service's command is the pool's: give --model FILE.gguf"
        )
    models = _words(src, "model") or []
    if len(models) != 1:
        raise InvalidInput(
            "--model", "a cooperative service needs one model file: --model /path/to/model.gguf"
        )
    path = models[0]
    if not path.startswith("/"):
        raise InvalidInput(
            src.where("model"), f"{path!r} is not an absolute path (the file's path on the nodes)"
        )
    coop: dict[str, Any] = {"model": path}
    python = _text(src, "engine_python")
    if python is not None:
        if not python.startswith("/"):
            raise InvalidInput(src.where("engine_python"), f"{python!r} is not an absolute path")
        coop["engine_python"] = python
    for key in ("ctx", "max_nodes", "force_split"):
        if src.get(key) is not None:
            coop[key] = _count(src, key)
    gain = src.get("min_gain")
    if gain is not None:
        try:
            coop["min_gain"] = float(gain)
        except (TypeError, ValueError):
            raise InvalidInput(src.where("min_gain"), f"expected a number, got {gain!r}") from None
    return coop
