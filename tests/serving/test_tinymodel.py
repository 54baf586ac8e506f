"""The tiny Llama GGUF: written reproducibly from a seed, read back as a Llama model by the gguf
package, and loaded and decoded by llama.cpp itself (from the llama venv) greedily and
deterministically, in printable text exactly max_tokens long."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf", reason="writing the model needs the `serve` extra (gguf)")

from computepool.serving.tinymodel import (  # noqa: E402
    CONTEXT,
    FFN,
    HIDDEN,
    N_LAYERS,
    VOCAB,
    byte_token,
    write_tiny_llama,
)


def field(reader: gguf.GGUFReader, key: str) -> object:
    return reader.fields[key].contents()


def test_same_seed_same_file_other_seed_other_weights(tmp_path: Path) -> None:
    a = write_tiny_llama(tmp_path / "a" / "m.gguf", seed=3)
    b = write_tiny_llama(tmp_path / "b.gguf", seed=3)
    c = write_tiny_llama(tmp_path / "c.gguf", seed=4)
    assert a == tmp_path / "a" / "m.gguf"
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    assert a.stat().st_size < 512 * 1024


def test_read_back_as_a_llama_model(tmp_path: Path) -> None:
    r = gguf.GGUFReader(write_tiny_llama(tmp_path / "m.gguf"))
    assert field(r, "general.architecture") == "llama"
    assert field(r, "llama.block_count") == N_LAYERS
    assert field(r, "llama.embedding_length") == HIDDEN
    assert field(r, "llama.feed_forward_length") == FFN
    assert field(r, "llama.context_length") == CONTEXT
    assert field(r, "tokenizer.ggml.model") == "llama"
    tokens = field(r, "tokenizer.ggml.tokens")
    assert isinstance(tokens, list) and len(tokens) == VOCAB
    assert tokens[byte_token(ord("A"))] == "<0x41>"
    shapes = {t.name: [int(n) for n in t.shape] for t in r.tensors}
    assert shapes["token_embd.weight"] == [HIDDEN, VOCAB]
    assert shapes["output.weight"] == [HIDDEN, VOCAB]
    assert shapes[f"blk.{N_LAYERS - 1}.ffn_down.weight"] == [FFN, HIDDEN]
    assert f"blk.{N_LAYERS}.attn_q.weight" not in shapes


DECODE = """
import json, sys
from llama_cpp import Llama
m = Llama(model_path=sys.argv[1], n_ctx=256, n_threads=1, verbose=False)
runs = []
for _ in range(2):
    m.reset()
    toks = []
    for t in m.generate(m.tokenize(b"The pool says"), temp=0.0, top_k=1):
        toks.append(t)
        if len(toks) == 40:
            break
    runs.append(toks)
text = m.create_completion("The pool says", max_tokens=40, temperature=0.0, repeat_penalty=1.0)
print(json.dumps({"runs": runs, "text": text["choices"][0]["text"], "usage": text["usage"],
                  "embd": m.n_embd(), "vocab": m.n_vocab(), "bos": m.token_bos(), "eos": m.token_eos()}))
"""


def decode(py: str, model: Path) -> dict[str, object]:
    r = subprocess.run(
        [py, "-c", DECODE, str(model)], capture_output=True, text=True, timeout=120, check=False
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return dict(json.loads(r.stdout.strip().splitlines()[-1]))


def test_llama_cpp_decodes_it_greedily_and_deterministically(tmp_path: Path, llama_python: str) -> None:
    out = decode(llama_python, write_tiny_llama(tmp_path / "m.gguf", seed=0))
    assert (out["embd"], out["vocab"], out["bos"], out["eos"]) == (HIDDEN, VOCAB, 1, 2)
    runs = out["runs"]
    assert isinstance(runs, list) and len(runs[0]) == 40 and runs[0] == runs[1]
    # only printable ASCII bytes, never EOS: the completion is the decoded tokens, all 40 of them
    assert all(byte_token(0x20) <= t < byte_token(0x7F) for t in runs[0])
    assert out["text"] == bytes(t - byte_token(0) for t in runs[0]).decode("ascii")
    # BOS, then the prompt's bytes with each space written as SentencePiece's "▁" (3 bytes)
    prompt = 1 + len("The pool says".replace(" ", "\u2581").encode())
    assert out["usage"] == {"prompt_tokens": prompt, "completion_tokens": 40, "total_tokens": prompt + 40}
    # another seed, other weights: another text
    other = decode(llama_python, write_tiny_llama(tmp_path / "o.gguf", seed=1))
    assert other["text"] != out["text"]


def test_command_line_writes_it_or_says_what_is_wrong(tmp_path: Path) -> None:
    run = [sys.executable, "-m", "computepool.serving.tinymodel"]
    ok = subprocess.run([*run, str(tmp_path / "m.gguf"), "5"], capture_output=True, text=True, check=False)
    assert ok.returncode == 0 and ok.stdout.strip() == str(tmp_path / "m.gguf"), ok.stderr
    assert (tmp_path / "m.gguf").read_bytes() == write_tiny_llama(tmp_path / "n.gguf", seed=5).read_bytes()
    bad = subprocess.run(
        [*run, str(tmp_path / "x.gguf"), "five"], capture_output=True, text=True, check=False
    )
    assert bad.returncode != 0 and bad.stderr.strip() == "SEED must be a whole number, not 'five'"
    assert not (tmp_path / "x.gguf").exists()
