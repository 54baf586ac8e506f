"""A tiny Llama-architecture model in GGUF, written on the spot, for testing real engines offline.

No model hub can be reached from the test machines, and a real model is far too large for them
anyway. llama.cpp loads this one like any Llama model and decodes it greedily and deterministically:
2 layers, hidden 64, 4 heads, a byte-level vocabulary (256 byte tokens besides UNK/BOS/EOS) and
seeded random weights. The output layer can only pick printable ASCII bytes and never EOS, so every
completion is valid text exactly `max_tokens` tokens long — what tests comparing engines need.

Needs the optional extra `serve` (`pip install 'computepool[serve]'`: gguf and numpy).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

N_LAYERS = 2
HIDDEN = 64
HEADS = 4
FFN = 128
CONTEXT = 256
# Token ids: llama.cpp's defaults for a SentencePiece ("llama") vocabulary, then the 256 bytes.
UNK, BOS, EOS = 0, 1, 2
FIRST_BYTE = 3
VOCAB = FIRST_BYTE + 256
PRINTABLE = range(0x20, 0x7F)


def byte_token(byte: int) -> int:
    """The token id of one byte in the tiny model's vocabulary."""
    return FIRST_BYTE + byte


def write_tiny_llama(path: Path, seed: int = 0) -> Path:
    """Write the model to `path` (about 0.2 MiB) and return it; the same seed gives the same file."""
    try:
        import gguf
    except ImportError as e:  # an optional extra: say how to get it
        raise RuntimeError("writing the tiny model needs gguf: pip install 'computepool[serve]'") from e

    rng = np.random.default_rng(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"computepool-tiny-llama-{seed}")
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(N_LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * 256
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * VOCAB)
    w.add_token_types(types)
    w.add_unk_token_id(UNK)
    w.add_bos_token_id(BOS)
    w.add_eos_token_id(EOS)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)

    def matrix(rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
        # numpy's (rows, cols) is GGUF's (cols, rows): llama.cpp multiplies by rows of `cols` inputs
        return (rng.standard_normal((rows, cols)) * scale / np.sqrt(cols)).astype(np.float16)

    ones = np.ones(HIDDEN, dtype=np.float32)
    w.add_tensor("token_embd.weight", (rng.standard_normal((VOCAB, HIDDEN))).astype(np.float16))
    for i in range(N_LAYERS):
        blk = f"blk.{i}"
        w.add_tensor(f"{blk}.attn_norm.weight", ones)
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(f"{blk}.{name}.weight", matrix(HIDDEN, HIDDEN))
        w.add_tensor(f"{blk}.ffn_norm.weight", ones)
        w.add_tensor(f"{blk}.ffn_gate.weight", matrix(FFN, HIDDEN))
        w.add_tensor(f"{blk}.ffn_up.weight", matrix(FFN, HIDDEN))
        w.add_tensor(f"{blk}.ffn_down.weight", matrix(HIDDEN, FFN))
    w.add_tensor("output_norm.weight", ones)
    # Rows left at zero give a logit of exactly 0, below the best of the 95 random printable rows:
    # greedy decoding never picks a control token, EOS or a byte outside printable ASCII. The wide
    # spread of the logits keeps the best one clear of the next, so engines agree on it.
    out = np.zeros((VOCAB, HIDDEN), dtype=np.float16)
    printable = [byte_token(b) for b in PRINTABLE]
    out[printable] = matrix(len(printable), HIDDEN, scale=8.0)
    w.add_tensor("output.weight", out)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def main() -> None:
    """`python -m computepool.serving.tinymodel PATH [SEED]`: write the model, print its path."""
    import sys

    if len(sys.argv) not in (2, 3):
        raise SystemExit("usage: python -m computepool.serving.tinymodel PATH [SEED]")
    seed = sys.argv[2] if len(sys.argv) == 3 else "0"
    if not seed.isdigit():
        raise SystemExit(f"SEED must be a whole number, not {seed!r}")
    print(write_tiny_llama(Path(sys.argv[1]), int(seed)))


if __name__ == "__main__":
    main()
