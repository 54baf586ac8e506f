"""The head of a split model: llama_cpp.server's OpenAI-compatible API over local and RPC layers.

Run by the service's replica as `PYTHON -c LOADER RELAY <this source> --model F --host IP --port N --ctx N
--threads N [--rpc EP,EP --n-gpu-layers K --tensor-split a,b] [--alias NAME]` (scripts.command) with
the llama venv's python (stdlib and llama_cpp only). The RPC servers become the devices this process
offloads to: llama.cpp counts the output layer as layer n_layer and gives the last K = --n-gpu-layers of those
n_layer+1 layers to the RPC servers, in --rpc order, divided by --tensor-split (planner.layer_params
writes both); the first layers and the input embeddings stay on the local CPU. The API key is read from
CPOOL_SERVICE_KEY. Health path: /health (answered without waiting for the model).

Each RPC server is reached through a relay of this process (relay.py): llama.cpp is given
127.0.0.1 listeners that accept only this process's own connections, each carried over a connection
authenticated with the plan's secret (CPOOL_COOP_SECRET, from the environment; required with --rpc).
Authenticated, not encrypted.

A lost peer ends the head at once (exit 3, one line `head: lost the RPC server EP ...` on stderr),
before anything more is sent to a client, so a stream breaks instead of ending normally: the relay
notices the peer's connection end (keepalives turn a peer that vanished without closing into an error
within ~25 s) and llama.cpp's aborts are reported the same way.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # at run time the loader has run relay.py in this namespace already
    from .relay import coop_secret, local_relays

LOST = 3  # exit status: a peer (or llama.cpp itself) failed; the pool re-plans


def fail(why: str, status: int = 2) -> None:
    os.write(2, f"head: {why}\n".encode())  # one write: llama.cpp writes to stderr too
    os._exit(status)  # llama.cpp may hold threads in blocking calls: no interpreter teardown


def add_server(rpc: Any, ep: str, timeout: float, name: str) -> int:
    """llama.cpp's registry entry for the RPC server `name` (reached at `ep`), within `timeout` s."""
    got: list[int | None] = []
    t = threading.Thread(target=lambda: got.append(rpc.ggml_backend_rpc_add_server(ep.encode())), daemon=True)
    t.start()
    t.join(timeout)
    if not got:
        fail(f"the RPC server {name} did not answer within {timeout:g} s (busy with another client?)", LOST)
    if not got[0]:
        fail(f"cannot connect to the RPC server {name}", LOST)
    return got[0] or 0


def use_rpc_servers(llama_cpp: Any, endpoints: list[str], timeout: float, names: list[str]) -> list[Any]:
    """Make the RPC servers the devices every model of this process offloads to, in order, and
    report llama.cpp's aborts in one line. Returns what must stay referenced.

    The Python `Llama` has no argument for devices: its default model parameters get them. Each
    connection gets `timeout` seconds: a server busy with another client never answers."""
    lib = Path(llama_cpp.__file__).parent / "lib"
    base = ctypes.CDLL(str(lib / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    rpc = ctypes.CDLL(str(lib / "libggml-rpc.so"), mode=ctypes.RTLD_GLOBAL)

    @ctypes.CFUNCTYPE(None, ctypes.c_char_p)
    def aborted(message: bytes | None) -> None:
        text = (message or b"").decode("utf-8", "replace").strip().splitlines()
        fail(f"llama.cpp aborted: {text[0].rsplit(': ', 1)[-1] if text else 'no message'}; exiting", LOST)

    base.ggml_set_abort_callback.argtypes = [ctypes.c_void_p]
    base.ggml_set_abort_callback(ctypes.cast(aborted, ctypes.c_void_p))
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
    return [aborted, listed]


def endpoint(text: str) -> str:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        fail(f"--rpc {text!r} is not ADDRESS:PORT")
    return text


def main() -> None:
    p = argparse.ArgumentParser(prog="head", description="serve a model split over llama.cpp RPC servers")
    p.add_argument("--model", required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rpc", default="", help="ADDRESS:PORT,... of the RPC servers, in layer order")
    p.add_argument("--n-gpu-layers", type=int, default=0, help="the last K layers go to the RPC servers")
    p.add_argument("--tensor-split", default="", help="how the K layers divide among the RPC servers")
    p.add_argument("--alias", default=None)
    p.add_argument("--connect-timeout", type=float, default=30.0)
    a = p.parse_args()
    eps = [endpoint(e) for e in a.rpc.split(",") if e]
    try:
        split = [float(x) for x in a.tensor_split.split(",") if x] or None
    except ValueError:
        fail(f"--tensor-split {a.tensor_split!r} is not numbers separated by commas")
    if split and len(split) != len(eps):
        fail(f"--tensor-split has {len(split)} parts for {len(eps)} RPC servers")
    if a.ctx < 16 or a.threads < 1 or not 0 < a.port < 65536 or a.n_gpu_layers < 0:
        fail("--ctx must be at least 16, --threads at least 1, --port a TCP port, --n-gpu-layers >= 0")
    if not os.path.isfile(a.model):
        fail(f"--model {a.model}: no such file")
    try:
        secret = coop_secret() if eps else b""
    except ValueError as e:
        fail(str(e))
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")  # an abort prints one line, never runs gdb
    llama_cpp = importlib.import_module("llama_cpp")  # by name: only the llama venv has it
    server = importlib.import_module("llama_cpp.server.app")
    settings = importlib.import_module("llama_cpp.server.settings")
    uvicorn = importlib.import_module("uvicorn")
    relays = local_relays(eps, secret, lambda why: fail(f"{why}; exiting", LOST))
    keep = use_rpc_servers(llama_cpp, relays, a.connect_timeout, eps) if eps else []  # noqa: F841
    model = settings.ModelSettings(
        model=a.model, model_alias=a.alias, n_ctx=a.ctx, n_threads=a.threads, n_threads_batch=a.threads,
        n_gpu_layers=a.n_gpu_layers if eps else 0, tensor_split=split, verbose=False,
    )  # fmt: skip
    key = os.environ.get("CPOOL_SERVICE_KEY") or None
    try:  # loads the model, placing its layers on the RPC devices
        # interrupt_requests off: by default llama_cpp.server ends a stream with [DONE] as soon as
        # another request waits for the model, and a health check would cut answers short
        serving = settings.ServerSettings(host=a.host, port=a.port, api_key=key, interrupt_requests=False)
        app = server.create_app(server_settings=serving, model_settings=[model])
    except (ValueError, RuntimeError, OSError) as e:
        fail(f"cannot load {a.model}: {e}", LOST if eps else 2)
    # the health path: the model is loaded once the app exists, and this answer waits for no lock
    # (llama_cpp.server's own routes, /v1/models too, queue behind a generation in progress)
    app.add_api_route("/health", lambda: {"status": "ok"}, methods=["GET"])
    uvicorn.run(app, host=a.host, port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
