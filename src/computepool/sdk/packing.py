"""What a function ships to the pool: one content-addressed code archive, and its calls' arguments.

The archive holds the function (cloudpickle, by value when it lives in `__main__`, a notebook or a
module of the caller's own tree), the caller's local modules (the working directory, packed with
its .gitignore/.cpoolignore rules, when a module was imported from it; other local roots under
`__cpool__/paths/`), cloudpickle itself (the node's Python may lack it) and the worker script. The
archive is deterministic, so registering the same function again re-uses the blob already held.
"""

from __future__ import annotations

import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import cloudpickle

WORKER_PATH = "__cpool__/worker.py"
FUNCTION_PATH = "__cpool__/function.pkl"
LIB_PREFIX = "__cpool__/lib"
PATHS_PREFIX = "__cpool__/paths"


@dataclass(frozen=True)
class LocalModule:
    name: str
    file: Path
    root: Path  # the sys.path entry it was imported from


@dataclass
class Shipment:
    """What `pack_function` decided: the archive's contents and the worker's import roots."""

    root: Path | None  # the working directory, shipped whole; None when no local module lives there
    extra_files: dict[str, bytes] = field(default_factory=dict)
    extra_trees: dict[str, Path] = field(default_factory=dict)
    sys_path: list[str] = field(default_factory=list)  # relative to the job's work dir


def _installed_dirs() -> list[Path]:
    """The standard library and every site dir: modules there are the node's business, not ours."""
    paths = sysconfig.get_paths()
    dirs = {paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    dirs |= {p for p in sys.path if p.rstrip("/").endswith(("site-packages", "dist-packages"))}
    dirs |= {sys.prefix, sys.base_prefix, sys.exec_prefix}
    return [Path(d).resolve() for d in dirs if d]


def _inside(path: Path, parent: Path) -> bool:
    return path == parent or parent in path.parents


def local_modules(cwd: Path | None = None) -> list[LocalModule]:
    """Modules loaded from the caller's own files: not the standard library, not an installed
    distribution, not this package. Each is found with the sys.path entry it was imported from."""
    cwd = (cwd or Path.cwd()).resolve()
    installed = _installed_dirs()
    ours = Path(__file__).resolve().parent.parent  # computepool itself: never shipped
    entries = [Path(p or ".").resolve() for p in sys.path]
    found: list[LocalModule] = []
    for name, module in list(sys.modules.items()):
        file = _module_file(module)
        if file is None or name == "__main__" or name.startswith("computepool"):
            continue
        if _inside(file, ours) or any(_inside(file, d) for d in installed):
            continue
        depth = name.count(".") + (2 if file.name == "__init__.py" else 1)
        root = file
        for _ in range(depth):
            root = root.parent
        if root in entries:
            found.append(LocalModule(name, file, root))
    return sorted(found, key=lambda m: m.name)


def _module_file(module: ModuleType | Any) -> Path | None:
    file = getattr(module, "__file__", None)
    if not isinstance(file, str) or not file.endswith(".py"):
        return None
    path = Path(file).resolve()
    return path if path.is_file() else None


def _worker_source() -> bytes:
    return (Path(__file__).parent / "worker.py").read_bytes()


def _is_local(module_name: str, mods: list[LocalModule]) -> bool:
    top = module_name.split(".")[0]
    return any(m.name.split(".")[0] == top for m in mods)


def pickle_function(fn: Any, mods: list[LocalModule]) -> bytes:
    """The function by value when its module is the caller's (local modules are imported by
    reference elsewhere, but the function itself must not need its decorated module on the node)."""
    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    by_value = module is not None and module.__name__ != "__main__" and _is_local(module.__name__, mods)
    if by_value:
        cloudpickle.register_pickle_by_value(module)
    try:
        return bytes(cloudpickle.dumps(fn))
    finally:
        if by_value:
            cloudpickle.unregister_pickle_by_value(module)


def shipment(fn: Any, cwd: Path | None = None) -> Shipment:
    """Everything the function needs on the node, short of its dependencies (pip) and the node's Python."""
    cwd = (cwd or Path.cwd()).resolve()
    mods = local_modules(cwd)
    # Only the modules themselves travel, never the whole directory they were imported from: a
    # notebook started in a home directory must not ship its dot-files (keys, credentials).
    out = Shipment(root=None)
    out.extra_files[WORKER_PATH] = _worker_source()
    out.extra_files[FUNCTION_PATH] = pickle_function(fn, mods)
    out.extra_trees[f"{LIB_PREFIX}/cloudpickle"] = Path(cloudpickle.__file__).resolve().parent
    roots: list[str] = []
    for root in _unique(m.root for m in mods):
        prefix = f"{PATHS_PREFIX}/{len(roots)}"
        roots.append(prefix)
        for m in mods:
            if m.root != root or "." in m.name:
                continue  # a package travels whole with its top level
            if m.file.name == "__init__.py":
                out.extra_trees[f"{prefix}/{m.name}"] = m.file.parent
            else:
                out.extra_files[f"{prefix}/{m.file.name}"] = m.file.read_bytes()
    out.sys_path = roots
    return out


def _unique(paths: Iterator[Path]) -> list[Path]:
    seen: list[Path] = []
    for p in paths:
        if p not in seen:
            seen.append(p)
    return seen


def pack_shipment(s: Shipment) -> bytes:
    from computepool.client.archive import pack

    return pack(s.root, extra_files=s.extra_files, extra_trees=s.extra_trees)


def pack_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    return bytes(cloudpickle.dumps((args, kwargs)))
