"""Command lines that run the cooperative engine's programs on a node.

The nodes run them with the llama venv's python, where computepool is not installed: each program
travels whole inside an allocation's command as `python -c LOADER RELAY PROGRAM ARGS...`, where
RELAY is engine/relay.py (the authenticated tunnel every program uses) and LOADER runs both sources
in one namespace and leaves ARGS as the program's sys.argv. The pool caps a command's argument at
8,192 characters: each source travels compacted (docstrings, comments, annotations and
`if TYPE_CHECKING:` blocks dropped, the code itself unchanged, through `ast`), must then fit in
MAX_SOURCE_BYTES (checked on use and by the tests), and may import only the standard library and
llama_cpp.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Literal

Program = Literal["rpc_server", "head", "probe"]
PROGRAMS: tuple[Program, ...] = ("rpc_server", "head", "probe")
SHARED = "relay"  # run before every program, in its namespace
LOADER = (
    "import sys\n"
    "shared, program = sys.argv[1:3]\n"
    "del sys.argv[1:3]\n"
    "space = {'__name__': '__main__', '__builtins__': __builtins__}\n"
    "exec(compile(shared, 'relay', 'exec'), space)\n"
    "exec(compile(program, sys.argv[0], 'exec'), space)\n"
)
MAX_SOURCE_BYTES = 7_500
ENGINE_DIR = Path(__file__).parent / "engine"


def _is_docstring(stmt: ast.stmt) -> bool:
    return (
        isinstance(stmt, ast.Expr)
        and isinstance(stmt.value, ast.Constant)
        and isinstance(stmt.value.value, str)
    )


class _Compactor(ast.NodeTransformer):
    """Drops what only readers and type checkers use: docstrings and annotations."""

    def generic_visit(self, node: ast.AST) -> ast.AST:
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and _is_docstring(body[0]):
            setattr(node, "body", body[1:] or [ast.Pass()])  # noqa: B010 (any node with a body)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            node.returns = None
        if isinstance(node, ast.arg):
            node.annotation = None
        return super().generic_visit(node)

    def visit_If(self, node: ast.If) -> ast.AST | None:
        if isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING" and not node.orelse:
            return None  # imports for the checkers only: the loader provides the names
        return self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.AST:
        if node.value is None:
            return ast.Pass()
        return ast.Assign(targets=[node.target], value=node.value, lineno=node.lineno)


def compact(text: str) -> str:
    """The same program without its docstrings, comments and annotations."""
    return ast.unparse(_Compactor().visit(ast.parse(text))) + "\n"


@cache
def source(program: Program | Literal["relay"]) -> str:
    """engine/<program>.py as it travels, checked to fit in an allocation's command."""
    if program not in (*PROGRAMS, SHARED):
        raise ValueError(f"unknown engine program {program!r}: one of {', '.join(PROGRAMS)}")
    text = compact((ENGINE_DIR / f"{program}.py").read_text())
    size = len(text.encode())
    if size > MAX_SOURCE_BYTES:
        raise ValueError(
            f"engine/{program}.py is {size} bytes compacted, over the {MAX_SOURCE_BYTES} allowed"
        )
    return text


def command(engine_python: str, program: Program, args: Sequence[str]) -> list[str]:
    """`[engine_python, "-c", LOADER, <source of relay>, <source of program>, *args]`."""
    if program not in PROGRAMS:
        raise ValueError(f"unknown engine program {program!r}: one of {', '.join(PROGRAMS)}")
    return [engine_python, "-c", LOADER, source(SHARED), source(program), *args]
