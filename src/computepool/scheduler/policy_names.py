"""The scoring policies' names, apart from their numpy code, so listing them costs no import."""

from __future__ import annotations

POLICIES = ("random", "dotprod", "clustering", "packing", "bestfit", "fgd", "default")
