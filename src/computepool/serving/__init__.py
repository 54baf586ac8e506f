"""Serving models on the pool: a small standard-library engine for tests and benchmarks, and the
tiny model the llama.cpp tests load."""
