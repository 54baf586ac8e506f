"""How the job launcher's Python steps are started: without `site`.

Every process job's chain starts one Python (the syscall filter's loader, or jobnet's launcher),
as root. `site` costs most of that start: it reads every `.pth` file in site-packages, and some
import whole packages at every start (a certificate bundle, a setuptools shim). With `-S` none
run, so the launcher is given the two directories it imports from itself: this package's and the
seccomp binding's. `-I` stays: a job's PYTHONPATH and the working directory choose nothing.
"""

from __future__ import annotations

import importlib.util
import sys
from functools import cache
from pathlib import Path

import computepool


@cache
def _import_paths() -> tuple[str, ...]:
    """Where `computepool` and `pyseccomp` (when installed) are imported from, this package's first."""
    paths = [str(Path(computepool.__file__).resolve().parent.parent)]
    spec = importlib.util.find_spec("pyseccomp")
    if spec is not None and spec.origin:
        where = str(Path(spec.origin).resolve().parent)
        if where not in paths:
            paths.append(where)
    return tuple(paths)


def module_argv(module: str, python: str = sys.executable) -> list[str]:
    """argv that runs `module`'s `main(argv)` as `python -m module` would, without `site`, importing
    from this install's paths (not through runpy: it imports a tenth of a job's start)."""
    if not module.replace(".", "").replace("_", "").isalnum():
        raise ValueError(f"not a module name: {module!r}")
    boot = (
        f"import sys; sys.path[:0] = {list(_import_paths())!r}; "
        f"from {module} import main; sys.exit(main(sys.argv[1:]))"
    )
    return [python, "-I", "-S", "-c", boot]
