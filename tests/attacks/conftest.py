"""Attack tests: a hostile tenant against another tenant and against the pool.

They use the server tests' fixtures (an app on SQLite or PostgreSQL, tokens) and the end-to-end
helpers (a real server and root agent on loopback), so both folders are importable from here.
"""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parent.parent
for _folder in ("server", "e2e", "agent"):
    if str(_TESTS / _folder) not in sys.path:
        sys.path.insert(0, str(_TESTS / _folder))

from server_fixtures import *  # noqa: E402, F403
from server_fixtures import pytest_generate_tests  # noqa: E402, F401
