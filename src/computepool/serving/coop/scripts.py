"""Command lines that run the cooperative engine's programs on a node.

The nodes run them with the llama venv's python, where computepool is not installed: each program
travels whole as `python -c SOURCE`, inside an allocation's command. The pool caps a command's
argument at 8,192 characters: a program travels compacted (docstrings and comments dropped, the
code itself unchanged, through `ast`), must then fit in MAX_SOURCE_BYTES (checked on use and by the
tests), and may import only the standard library and llama_cpp.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Literal

Program = Literal["rpc_server", "head", "probe"]
PROGRAMS: tuple[Program, ...] = ("rpc_server", "head", "probe")
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

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.AST:
        if node.value is None:
            return ast.Pass()
        return ast.Assign(targets=[node.target], value=node.value, lineno=node.lineno)


def compact(text: str) -> str:
    """The same program without its docstrings, comments and annotations."""
    return ast.unparse(_Compactor().visit(ast.parse(text))) + "\n"


@cache
def source(program: Program) -> str:
    """engine/<program>.py as it travels, checked to fit in an allocation's command."""
    if program not in PROGRAMS:
        raise ValueError(f"unknown engine program {program!r}: one of {', '.join(PROGRAMS)}")
    text = compact((ENGINE_DIR / f"{program}.py").read_text())
    size = len(text.encode())
    if size > MAX_SOURCE_BYTES:
        raise ValueError(
            f"engine/{program}.py is {size} bytes compacted, over the {MAX_SOURCE_BYTES} allowed"
        )
    return text


def command(engine_python: str, program: Program, args: Sequence[str]) -> list[str]:
    """`[engine_python, "-c", <source of program>, *args]`."""
    return [engine_python, "-c", source(program), *args]
