"""The layers of docs/architecture.md: each package of `computepool` imports only those below it.

Read from the source with `ast` (imports inside functions count too), so a shortcut that works
at run time still fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import computepool

ROOT = Path(computepool.__file__).parent
# What each layer may import besides itself (`cli` sits on top and may import anything).
ALLOWED = {
    "core": set(),
    "scheduler": {"core"},
    "store": {"core"},
    "sim": {"core", "scheduler"},
    "wire": {"core"},  # the API's messages: server, client, SDK and agent share one definition
    "server": {"core", "wire", "scheduler", "store", "discovery", "serving"},
    "agent": {"core", "wire", "discovery"},
    "client": {"core", "wire", "serving", "discovery"},
    "sdk": {"core", "wire", "client"},
    "serving": set(),  # engines and traces that run as a tenant's job: nothing of the pool's
    "discovery": set(),  # signed LAN announcements: shared by the agent, the server and benchmarks
    "chaos": set(),  # a pool under faults, seen from outside: its processes, HTTP and database
}


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out.update(n.split(".")[1] for n in names if n.startswith("computepool.") and n.count(".") >= 1)
    return out


def test_every_layer_imports_only_the_layers_below() -> None:
    assert set(ALLOWED) | {"cli"} == {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    wrong = [
        f"{path.relative_to(ROOT)} imports computepool.{target}"
        for layer, allowed in ALLOWED.items()
        for path in sorted((ROOT / layer).rglob("*.py"))
        for target in sorted(_imports(path) - allowed - {layer})
    ]
    assert wrong == []


def test_the_check_sees_imports_inside_functions(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from computepool.server import app\n    import computepool.store.db\n")
    assert _imports(f) == {"server", "store"}
