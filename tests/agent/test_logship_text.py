"""What the agent sends of a job's output bytes: whole characters, and no NUL (the control plane's
text columns hold none), counted the way the control plane counts the stream's offsets."""

from __future__ import annotations

from computepool.agent.logship import _utf8_chunk


def test_a_nul_goes_out_as_a_replacement_character() -> None:
    raw, text = _utf8_chunk(b"a\x00b\n", final=False)
    assert raw == b"a\x00b\n" and text == "a\ufffdb\n"


def test_a_character_cut_at_the_chunk_end_waits_for_the_next_chunk() -> None:
    euro = "€".encode()
    raw, text = _utf8_chunk(b"x" + euro[:2], final=False)
    assert (raw, text) == (b"x", "x")
    raw, text = _utf8_chunk(b"x" + euro[:2], final=True)  # the file ends there: replaced, not held
    assert raw == b"x" + euro[:2] and text == "x\ufffd"
