"""Standalone engine programs run by allocations with the llama venv's python (stdlib + llama_cpp only)."""
