"""The pool's log lines stay one line each, whatever text a tenant put in them."""

from __future__ import annotations

import io
import logging

from computepool.core.logfmt import OneLineFormatter


def test_a_tenants_newline_or_escape_forges_no_line_and_a_traceback_keeps_its_lines() -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(OneLineFormatter("%(levelname)s %(name)s: %(message)s"))
    log = logging.getLogger("test-logfmt")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("exec in %s: %s", "7#1", "ls\nINFO computepool.agent: 9#1 ended: succeeded\x1b[2K")
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("a failure with %s", "a\rb")
    finally:
        log.removeHandler(handler)
    lines = out.getvalue().splitlines()
    forged = "ls\\x0aINFO computepool.agent: 9#1 ended: succeeded\\x1b[2K"
    assert lines[0] == f"WARNING test-logfmt: exec in 7#1: {forged}"
    assert lines[1] == "ERROR test-logfmt: a failure with a\\x0db"
    assert lines[2] == "Traceback (most recent call last):" and lines[-1] == "ValueError: boom"
