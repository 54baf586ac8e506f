"""A simulated OpenAI-compatible inference engine, using only the standard library.

It stands in for a real engine (llama.cpp, vLLM) where the test is about the pool and not the
model: it answers /v1/completions, /v1/chat/completions (also streamed as Server-Sent Events),
/v1/embeddings, /v1/models and /health with deterministic text and a correct `usage`. An answer
takes prefill (a tenth of --ms-per-token per prompt token) plus --ms-per-token per completion
token, and at most --slots requests are worked on at once (the others wait inside), as on a
real engine with a fixed batch.

The file imports nothing from computepool, so it can be shipped as a replica's code and run by
any python3 >= 3.9 as the tenant's user:

    python3 simengine.py --port 8000 --slots 4 --ms-per-token 5 --seed 0

With a key (--api-key, or CPOOL_SERVICE_KEY, which the pool gives each replica) /v1/* answers 401
unless the request carries `Authorization: Bearer KEY`, as the gateway's do: the replica's port
is open to the whole network, the gateway's checks only to who goes through it. /health stays open.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

WORDS = (
    "the",
    "pool",
    "lends",
    "idle",
    "cards",
    "to",
    "work",
    "that",
    "waits",
    "and",
    "takes",
    "them",
    "back",
    "when",
    "the",
    "service",
    "needs",
    "them",
    "again",
    "so",
    "every",
    "device",
    "stays",
    "busy",
    "through",
    "the",
    "peaks",
    "and",
    "the",
    "troughs",
    "of",
    "a",
    "day",
)
DEFAULT_MAX_TOKENS = 16
MAX_TOKENS = 4096
EMBEDDING_DIM = 16


def count_tokens(text: str) -> int:
    """Whitespace-separated words, at least one: what this engine calls a token."""
    return max(1, len(text.split()))


def completion_words(prompt: str, n: int, seed: int) -> list[str]:
    """`n` words chosen by a hash of the prompt and the seed: the same question, the same answer."""
    digest = hashlib.sha256(f"{seed}\0{prompt}".encode()).digest()
    out = []
    for i in range(n):
        out.append(WORDS[(digest[i % len(digest)] + 7 * i) % len(WORDS)])
    return out


def embed(text: str, seed: int) -> list[float]:
    digest = hashlib.sha256(f"{seed}\0{text}".encode()).digest()
    return [round((digest[i] - 127.5) / 127.5, 6) for i in range(EMBEDDING_DIM)]


def chat_prompt(messages: Any) -> str:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: a non-empty list is required")
    parts = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("content", ""), str):
            raise ValueError("messages: each message needs a string content")
        parts.append(f"{m.get('role', 'user')}: {m.get('content', '')}")
    return "\n".join(parts)


class Engine:
    """The model: slots, timing and the deterministic answers."""

    def __init__(self, model: str, slots: int, ms_per_token: float, seed: int) -> None:
        self.model = model
        self.ms_per_token = ms_per_token
        self.seed = seed
        self.slots = threading.BoundedSemaphore(slots)
        self.created = int(time.time())
        self.served = 0
        self.lock = threading.Lock()

    def sleep_tokens(self, tokens: float) -> None:
        if self.ms_per_token > 0 and tokens > 0:
            time.sleep(tokens * self.ms_per_token / 1000.0)

    def prefill(self, prompt_tokens: int) -> None:
        self.sleep_tokens(prompt_tokens / 10.0)

    def done(self) -> None:
        with self.lock:
            self.served += 1


def max_tokens_of(body: dict[str, Any]) -> int:
    value = body.get("max_tokens", body.get("max_completion_tokens", DEFAULT_MAX_TOKENS))
    if value is None:
        return DEFAULT_MAX_TOKENS
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_TOKENS:
        raise ValueError(f"max_tokens: an integer from 1 to {MAX_TOKENS} is required")
    return value


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # headers and body go out as separate writes: with Nagle's algorithm the body would wait for
    # the client's delayed ACK (40 ms) on every kept-alive request
    disable_nagle_algorithm = True
    server_version = "simengine/1"
    engine: Engine
    api_key: str = ""  # when set, /v1/* asks for it as a bearer token

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        if os.environ.get("SIMENGINE_LOG"):
            sys.stderr.write("simengine: " + (format % args) + "\n")

    # -- plumbing -------------------------------------------------------------------------------

    def send_json(self, status: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def error(self, status: int, message: str) -> None:
        self.send_json(status, {"error": {"message": message, "type": "invalid_request_error", "code": None}})

    def read_body(self) -> dict[str, Any] | None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw or b"null")
        except ValueError:
            self.error(400, "the body is not JSON")
            return None
        if not isinstance(body, dict):
            self.error(400, "the body must be a JSON object")
            return None
        return body

    def chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def sse(self, obj: Any) -> None:
        payload = obj if isinstance(obj, str) else json.dumps(obj)
        self.chunk(f"data: {payload}\n\n".encode())

    def allowed(self) -> bool:
        """Whether the request shows the key (if there is one); answers 401 when it does not."""
        if not self.api_key:
            return True
        scheme, _, given = self.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.api_key.encode()):
            return True
        self.close_connection = True  # its body, if any, is left unread: no next request on this connection
        data = json.dumps(
            {"error": {"message": "invalid or missing API key", "type": "invalid_request_error",
                       "code": "invalid_api_key"}}
        ).encode()  # fmt: skip
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("WWW-Authenticate", "Bearer")
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)
        return False

    # -- routes ---------------------------------------------------------------------------------

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path in ("/health", "/healthz"):
            self.send_json(200, {"status": "ok", "served": self.engine.served})
        elif path.startswith("/v1/") and not self.allowed():
            return
        elif path == "/v1/models":
            model = {"id": self.engine.model, "object": "model", "created": self.engine.created}
            self.send_json(200, {"object": "list", "data": [dict(model, owned_by="simengine")]})
        else:
            self.error(404, f"no route {path}")

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        if path.startswith("/v1/") and not self.allowed():
            return
        routes = {
            "/v1/completions": self.completions,
            "/v1/chat/completions": self.chat,
            "/v1/embeddings": self.embeddings,
        }
        route = routes.get(path)
        if route is None:
            self.error(404, f"no route {path}")
            return
        body = self.read_body()
        if body is None:
            return
        try:
            route(body)
        except ValueError as exc:
            self.error(400, str(exc))
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def completions(self, body: dict[str, Any]) -> None:
        prompt = body.get("prompt", "")
        if isinstance(prompt, list):
            prompt = " ".join(str(p) for p in prompt)
        if not isinstance(prompt, str):
            raise ValueError("prompt: a string is required")
        self.generate(body, prompt, chat=False)

    def chat(self, body: dict[str, Any]) -> None:
        self.generate(body, chat_prompt(body.get("messages")), chat=True)

    def generate(self, body: dict[str, Any], prompt: str, chat: bool) -> None:
        n = max_tokens_of(body)
        stream = bool(body.get("stream"))
        options = body.get("stream_options") or {}
        include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        engine = self.engine
        words = completion_words(prompt, n, engine.seed)
        p_tokens = count_tokens(prompt)
        rid = "cmpl-" + hashlib.sha256(f"{time.time_ns()}{id(self)}".encode()).hexdigest()[:12]
        kind = "chat.completion" if chat else "text_completion"
        with engine.slots:
            engine.prefill(p_tokens)
            if not stream:
                engine.sleep_tokens(n)
                text = " ".join(words)
                if chat:
                    message = {"role": "assistant", "content": text}
                    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": "length"}
                else:
                    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
                self.send_json(200, {
                    "id": rid, "object": kind, "created": int(time.time()), "model": engine.model,
                    "choices": [choice], "usage": usage(p_tokens, n),
                })  # fmt: skip
                engine.done()
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            kind_chunk = "chat.completion.chunk" if chat else "text_completion"
            for i, word in enumerate(words):
                engine.sleep_tokens(1)
                piece = word if i == 0 else " " + word
                if chat:
                    delta: dict[str, Any] = {"content": piece}
                    if i == 0:
                        delta["role"] = "assistant"
                    ch: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": None}
                else:
                    ch = {"index": 0, "text": piece, "logprobs": None, "finish_reason": None}
                if i == n - 1:
                    ch["finish_reason"] = "length"
                self.sse({"id": rid, "object": kind_chunk, "created": int(time.time()),
                          "model": engine.model, "choices": [ch]})  # fmt: skip
            if include_usage:
                self.sse({"id": rid, "object": kind_chunk, "created": int(time.time()),
                          "model": engine.model, "choices": [], "usage": usage(p_tokens, n)})  # fmt: skip
            self.sse("[DONE]")
            self.chunk(b"")
            engine.done()

    def embeddings(self, body: dict[str, Any]) -> None:
        inputs = body.get("input")
        if isinstance(inputs, str):
            inputs = [inputs]
        if not isinstance(inputs, list) or not inputs or not all(isinstance(i, str) for i in inputs):
            raise ValueError("input: a string or a non-empty list of strings is required")
        engine = self.engine
        tokens = sum(count_tokens(i) for i in inputs)
        with engine.slots:
            engine.prefill(tokens)
            data = [{"object": "embedding", "index": i, "embedding": embed(t, engine.seed)}
                    for i, t in enumerate(inputs)]  # fmt: skip
            self.send_json(200, {"object": "list", "data": data, "model": engine.model,
                                 "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})  # fmt: skip
            engine.done()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="A simulated OpenAI-compatible engine (standard library only).")
    ap.add_argument("--port", type=int, default=None, help="Port to listen on (default: $PORT).")
    ap.add_argument("--host", default="0.0.0.0", help="Address to listen on (default: all).")
    ap.add_argument("--slots", type=int, default=4, help="Requests worked on at once.")
    ap.add_argument("--ms-per-token", type=float, default=5.0, help="Milliseconds per completion token.")
    ap.add_argument("--seed", type=int, default=0, help="Seed of the deterministic answers.")
    ap.add_argument("--model", default="sim", help="The model name /v1/models reports.")
    ap.add_argument(
        "--api-key",
        default=os.environ.get("CPOOL_SERVICE_KEY", ""),
        help="Answer /v1/* only with `Authorization: Bearer KEY` (default: $CPOOL_SERVICE_KEY).",
    )
    args = ap.parse_args(argv)
    port = args.port if args.port is not None else int(os.environ.get("PORT", "0") or 0)
    if not 0 < port < 65536:
        ap.error("--port: give a port from 1 to 65535 (or set PORT)")
    if args.slots < 1:
        ap.error("--slots: at least 1")
    if args.ms_per_token < 0:
        ap.error("--ms-per-token: not negative")
    Handler.engine = Engine(args.model, args.slots, args.ms_per_token, args.seed)
    Handler.api_key = args.api_key
    server = ThreadingHTTPServer((args.host, port), Handler)
    server.daemon_threads = True

    def stop(signum: int, frame: Any) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    sys.stderr.write(f"simengine: listening on {args.host}:{port}\n")
    sys.stderr.flush()
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
