"""Pydantic models of the HTTP API: what goes in (extra fields refused) and what comes out."""
