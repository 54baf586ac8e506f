"""Log lines that stay one line each: tenants' text (a command, a path, a name) reaches the pool's
logs, and a newline or terminal escape in it must not forge a line the operator reads as the
pool's own. Control characters in a record's message are written as `\\xNN` escapes; a traceback
appended to the record keeps its lines."""

from __future__ import annotations

import logging

_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, *range(0x80, 0xA0))}


def one_line(text: str) -> str:
    return text.translate(_ESCAPES)


class OneLineFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        saved = record.msg, record.args
        record.msg, record.args = one_line(record.getMessage()), None
        try:
            return super().format(record)
        finally:
            record.msg, record.args = saved


def configure(level: str, fmt: str) -> None:
    """`logging.basicConfig` with the one-line formatter on its handler."""
    logging.basicConfig(level=level.upper(), format=fmt)
    for handler in logging.getLogger().handlers:
        handler.setFormatter(OneLineFormatter(fmt))
