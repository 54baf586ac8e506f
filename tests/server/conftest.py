"""The server tests' fixtures live in server_fixtures.py, which the attack tests share."""

from server_fixtures import *  # noqa: F403
from server_fixtures import pytest_generate_tests  # noqa: F401
