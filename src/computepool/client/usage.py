"""Client calls for usage, prices and the static equivalent (being built)."""

from __future__ import annotations


class UsageMethods:
    """Mixed into PoolClient."""
