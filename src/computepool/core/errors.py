"""Errors shared by every layer: each names the field (or file and line) that was wrong."""

from __future__ import annotations


class InvalidInput(ValueError):
    """Bad input from a user or a file; `where` names the field or the file:line at fault."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(f"{where}: {message}")
        self.where = where
        self.message = message
