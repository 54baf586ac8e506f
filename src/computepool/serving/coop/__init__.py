"""Cooperative inference: one GGUF model split over devices of several nodes by llama.cpp RPC."""
