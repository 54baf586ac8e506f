"""Measure how fast this node (or, through --rpc, a remote RPC server) decodes a model greedily.

Run by a probe allocation as `PYTHON -c LOADER RELAY <this source> --model F --tokens N --ctx N
--threads N [--rpc EP --n-gpu-layers K]` (scripts.command) with the llama venv's python (stdlib and
llama_cpp only). RPC servers are reached through this process's authenticated relays (relay.py; the
secret comes from CPOOL_COOP_SECRET, required with --rpc). It loads the
model, warms up, decodes N tokens from a fixed prompt and prints one line `CPOOL-PROBE {json}`:
tokens_per_s (decoding only: the prompt's evaluation is left out), the model's shape (n_layer, n_embd,
n_vocab, n_params, model_bytes, and the planner's layer_bytes/embd_bytes estimates), text (the greedy
output, for comparing engines), load_s and threads. Failures exit 1 with one line on stderr (2: bad
arguments or no secret).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # at run time the loader has run relay.py in this namespace already
    from .relay import coop_secret, local_relays

PROMPT = b"The pool measures"


def _digest(path: str) -> str:
    """SHA-256 of the file's first and last MiB: tells two different files of one size apart cheaply."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, os.fstat(f.fileno()).st_size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:32]


def fail(why: str, status: int = 1) -> None:
    os.write(2, f"probe: {why}\n".encode())  # one write: llama.cpp writes to stderr too
    os._exit(status)  # also when llama.cpp still holds a thread in a blocking call


def add_server(rpc: Any, ep: str, timeout: float, name: str) -> int:
    """llama.cpp's registry entry for the RPC server `name` (reached at `ep`), within `timeout` s."""
    got: list[int | None] = []
    t = threading.Thread(target=lambda: got.append(rpc.ggml_backend_rpc_add_server(ep.encode())), daemon=True)
    t.start()
    t.join(timeout)
    if not got:
        fail(f"the RPC server {name} did not answer within {timeout:g} s (busy with another client?)")
    if not got[0]:
        fail(f"cannot connect to the RPC server {name}")
    return got[0] or 0


def use_rpc_servers(llama_cpp: Any, endpoints: list[str], timeout: float, names: list[str]) -> Any:
    """Make the RPC servers the devices models of this process offload to (the Python `Llama` has no
    argument for them: its default model parameters get them); returns what must stay referenced.
    Each connection gets `timeout` seconds: a server busy with another client never answers."""
    lib = Path(llama_cpp.__file__).parent / "lib"
    base = ctypes.CDLL(str(lib / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    rpc = ctypes.CDLL(str(lib / "libggml-rpc.so"), mode=ctypes.RTLD_GLOBAL)
    rpc.ggml_backend_rpc_add_server.restype = ctypes.c_void_p
    rpc.ggml_backend_rpc_add_server.argtypes = [ctypes.c_char_p]
    base.ggml_backend_reg_dev_count.restype = ctypes.c_size_t
    base.ggml_backend_reg_dev_count.argtypes = [ctypes.c_void_p]
    base.ggml_backend_reg_dev_get.restype = ctypes.c_void_p
    base.ggml_backend_reg_dev_get.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    count = base.ggml_backend_reg_dev_count
    devices: list[int] = []
    for ep, name in zip(endpoints, names, strict=True):
        reg = add_server(rpc, ep, timeout, name)
        devices += [base.ggml_backend_reg_dev_get(reg, i) for i in range(count(reg))]
    listed = (ctypes.c_void_p * (len(devices) + 1))(*devices, None)  # NULL-terminated
    defaults = llama_cpp.llama_cpp.llama_model_default_params

    def with_devices() -> Any:
        params = defaults()
        params.devices = ctypes.cast(listed, ctypes.c_void_p)
        return params

    llama_cpp.llama_cpp.llama_model_default_params = with_devices
    return listed


def decode(model: Any, tokens: int) -> tuple[list[int], float]:
    """Greedy tokens after PROMPT, and the decoding speed between the first token and the last."""
    out: list[int] = []
    first = last = time.perf_counter()
    for tok in model.generate(model.tokenize(PROMPT), temp=0.0, top_k=1, repeat_penalty=1.0):
        last = time.perf_counter()
        if not out:
            first = last
        out.append(tok)
        if len(out) == tokens:
            break
    return out, (len(out) - 1) / max(last - first, 1e-9)


def main() -> None:
    p = argparse.ArgumentParser(prog="probe", description="measure greedy decoding speed")
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rpc", default="", help="ADDRESS:PORT of the RPC server to measure")
    p.add_argument("--n-gpu-layers", type=int, default=-1, help="layers on the RPC server (-1: all)")
    p.add_argument("--connect-timeout", type=float, default=30.0)
    a = p.parse_args()
    if a.tokens < 2 or a.ctx < 16 or a.threads < 1:
        fail("--tokens must be at least 2, --ctx at least 16 and --threads at least 1")
    if not os.path.isfile(a.model):
        fail(f"--model {a.model}: no such file")
    result_fd = os.dup(1)  # stdout carries only the result: llama.cpp's own printing goes to stderr
    os.dup2(2, 1)
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")  # an abort prints one line, never runs gdb
    llama_cpp = importlib.import_module("llama_cpp")  # by name: only the llama venv has it
    endpoints = [e for e in a.rpc.split(",") if e]
    try:
        secret = coop_secret() if endpoints else b""
    except ValueError as e:
        fail(str(e), 2)
    relays = local_relays(endpoints, secret, fail)
    keep = use_rpc_servers(llama_cpp, relays, a.connect_timeout, endpoints) if endpoints else None  # noqa: F841
    start = time.perf_counter()
    try:
        m = llama_cpp.Llama(model_path=a.model, n_ctx=a.ctx, n_threads=a.threads, verbose=False,
                            n_gpu_layers=(a.n_gpu_layers if endpoints else 0))  # fmt: skip
    except (ValueError, RuntimeError) as e:
        fail(f"cannot load {a.model}: {e}")
    load_s = time.perf_counter() - start
    decode(m, min(4, a.tokens))  # warm-up: first-use allocations and caches
    out, speed = decode(m, a.tokens)
    n_layer = int(llama_cpp.llama_model_n_layer(m.model))
    n_vocab, n_embd = int(m.n_vocab()), int(m.n_embd())
    size, params = int(llama_cpp.llama_model_size(m.model)), int(llama_cpp.llama_model_n_params(m.model))
    # the input embeddings and the output layer, both n_vocab x n_embd, stay on the head; the rest is
    # the repeating layers (an estimate: it counts a tied output matrix twice, the safe way)
    embd = min(size, round(2 * n_vocab * n_embd * size / max(params, 1)))
    result = {
        "tokens_per_s": round(speed, 3), "tokens": len(out), "n_layer": n_layer, "n_embd": n_embd,
        "n_vocab": n_vocab, "n_params": params, "model_bytes": size, "embd_bytes": embd,
        "layer_bytes": (size - embd) // max(n_layer, 1), "text": m.detokenize(out).decode("utf-8", "replace"),
        "load_s": round(load_s, 3), "threads": a.threads, "rpc": endpoints,
        "n_gpu_layers": a.n_gpu_layers if endpoints else 0, "file_size": os.stat(a.model).st_size,
        "file_digest": _digest(a.model),
    }  # fmt: skip
    os.write(result_fd, f"CPOOL-PROBE {json.dumps(result)}\n".encode())
    os._exit(0)  # skip llama.cpp's teardown: freeing remote buffers of a dying peer could abort


if __name__ == "__main__":
    main()
