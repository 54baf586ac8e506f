"""What the authenticated discovery path costs per announcement, for the README's figures: signing
(HMAC-SHA256 over the canonical JSON), verifying, and the TXT round trip mDNS adds."""

from __future__ import annotations

import time
from collections.abc import Callable

from computepool.discovery.announce import Announcement, DeviceSummary, derive_key, fingerprint, verify


def auth_cost(n: int = 20000) -> dict[str, float]:
    """Microseconds per announcement (a typical one: a GPU and a CPU) for each step, best of 3 runs."""
    if n < 1:
        raise ValueError("n must be at least 1")
    key = derive_key(b"computepool bench secret")
    now = time.time()
    ann = Announcement(
        pool=fingerprint(key),
        node_id="bench-node-01",
        instance="0123456789abcdef",
        address="192.168.1.10",
        port=5757,
        issued_at=now,
        devices=(DeviceSummary(0, "gpu", "NVIDIA H200", 143771), DeviceSummary(0, "cpu", "cpu", 128000)),
    )
    signed = ann.signed(key)
    txt = signed.to_txt()

    def sign() -> None:
        ann.signed(key)

    def check() -> None:
        if verify(signed, key, now) is not None:
            raise AssertionError("the bench announcement does not verify")

    def txt_round_trip() -> None:
        Announcement.from_txt(signed.to_txt())

    def receive() -> None:  # what a receiver does per mDNS announcement: parse TXT, then verify
        verify(Announcement.from_txt(txt), key, now)

    out: dict[str, float] = {"n": float(n)}
    for name, fn in (
        ("sign_us", sign),
        ("verify_us", check),
        ("txt_us", txt_round_trip),
        ("receive_us", receive),
    ):
        best = min(_timed(fn, n) for _ in range(3))
        out[name] = round(best / n * 1e6, 2)
    return out


def _timed(fn: Callable[[], None], n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return time.perf_counter() - start
