"""The gateway's parts on their own: token buckets, reading usage off a stream, the FIFO queue and
its bounds, bounded usage counts."""

from __future__ import annotations

import asyncio
import json

from computepool.server.gateway.balancer import Balancer, QueueFull, QueueTimeout, Replica
from computepool.server.gateway.limiter import RateLimiter
from computepool.server.gateway.usage import (
    MAX_SUM,
    MAX_TOKENS,
    StreamUsage,
    Tokens,
    UsageBook,
    tokens_in_body,
)
from computepool.store.gateway import UsageCount


def test_token_bucket_bursts_then_refills_at_the_rate() -> None:
    lim = RateLimiter()
    lim.set_limits({"t1": (30, 3)})  # one every 2 s, bursts of 3
    assert [lim.take("t1", now=100.0) for _ in range(3)] == [None, None, None]
    assert lim.take("t1", now=100.0) == 2  # a whole token is 2 s away
    assert lim.take("t1", now=101.5) == 1  # a quarter of one is missing: rounded up to 1 s
    assert lim.take("t1", now=102.0) is None
    assert lim.take("t2", now=102.0) is None  # no limit for t2
    lim.set_limits({"t1": (6000, 1)})  # a new limit keeps what was left, capped by the new burst
    assert lim.take("t1", now=102.0) == 1
    assert lim.take("t1", now=102.01) is None
    lim.set_limits({})
    assert all(lim.take("t1", now=102.01) is None for _ in range(10))


def test_a_tenant_without_a_limit_of_its_own_gets_the_default() -> None:
    lim = RateLimiter(default=(60, 2))  # one a second, bursts of 2
    lim.set_limits({"own": (600, 5)})
    assert [lim.take("t", now=10.0) for _ in range(3)] == [None, None, 1]
    assert [lim.take("own", now=10.0) for _ in range(6)] == [None] * 5 + [1]
    assert lim.take("t", now=11.0) is None
    lim.set_limits({})  # its own limit gone: the default applies to it too
    assert [lim.take("own", now=11.0) for _ in range(2)] == [None, 1]
    assert all(RateLimiter(default=(0, 9)).take("t", now=1.0) is None for _ in range(20))  # 0: none


def _sse(obj: object) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def test_stream_usage_reads_lines_split_anywhere() -> None:
    chunks = [{"choices": [{"delta": {"content": w}}]} for w in ("a", " b", "")]
    stream = b"".join(_sse(c) for c in chunks) + _sse(
        {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}}
    )
    stream += _sse(b"[DONE]")
    for cut in (1, 7, 13, len(stream) // 2):
        seen = StreamUsage()
        for i in range(0, len(stream), cut):
            seen.feed(stream[i : i + cut])
        assert seen.tokens() == Tokens(4, 2) and seen.content_chunks == 2
    plain = StreamUsage()
    plain.feed(b"".join(_sse({"choices": [{"text": t}]}) for t in ("x", "y", "z")) + b"data: {broken\n\n")
    assert plain.tokens() == Tokens(0, 3)
    assert tokens_in_body(b'{"usage": {"prompt_tokens": 5, "completion_tokens": true}}') == Tokens(5, 0)
    assert tokens_in_body(b"not json") == Tokens() == tokens_in_body(b"[1]")


def test_queue_is_fifo_and_a_freed_place_goes_to_the_oldest() -> None:
    async def settle() -> None:
        for _ in range(5):
            await asyncio.sleep(0)

    async def scenario() -> None:
        b = Balancer()
        r1, r2 = Replica(1, "http://a"), Replica(2, "http://b")
        b.update(7, [r1, r2], limit=1)
        first, second = await b.acquire(7, 1), await b.acquire(7, 1)
        assert {first, second} == {r1, r2}
        order: list[int] = []

        async def wait(n: int) -> Replica:
            got = await b.acquire(7, 5)
            order.append(n)
            return got

        waiting = [asyncio.create_task(wait(n)) for n in range(3)]
        await asyncio.sleep(0)
        assert b.load(7).queued == 3 and b.load(7).inflight == 2
        b.release(7, first)
        b.release(7, second)
        await settle()
        assert order == [0, 1] and b.load(7).queued == 1
        b.release(7, await waiting[0])
        await settle()
        assert order == [0, 1, 2]
        try:
            await b.acquire(7, 0.05)
            raise AssertionError("acquired beyond the per-replica limit")
        except QueueTimeout:
            pass
        assert b.load(7).queued == 0  # the timed-out waiter left the queue
        b.update(7, [r1, r2, Replica(3, "http://c")], limit=1)  # a new replica takes the next at once
        assert (await b.acquire(7, 1)).allocation_id == 3
        assert b.load(7).per_replica == {1: 1, 2: 1, 3: 1}  # waiters 1 and 2 still hold theirs

    asyncio.run(scenario())


def test_queues_are_bounded_per_service_and_per_tenant() -> None:
    async def scenario() -> None:
        b = Balancer(max_waiters=2, max_tenant_waiters=3)
        b.update(1, [], limit=1)
        b.update(2, [], limit=1)
        waiting = [asyncio.create_task(b.acquire(sid, 5, tenant="t")) for sid in (1, 1, 2)]
        await asyncio.sleep(0)
        assert (b.load(1).queued, b.load(2).queued) == (2, 1)
        try:
            await b.acquire(1, 5, tenant="u")
            raise AssertionError("a third waiter joined a queue of two")
        except QueueFull as e:
            assert (e.limit, e.of_tenant) == (2, False)
        try:
            await b.acquire(2, 5, tenant="t")
            raise AssertionError("a fourth waiter of tenant t was queued")
        except QueueFull as e:
            assert (e.limit, e.of_tenant) == (3, True)
        waiting[0].cancel()
        await asyncio.gather(waiting[0], return_exceptions=True)
        late = asyncio.create_task(b.acquire(2, 5, tenant="t"))  # the cancelled one's place is free
        await asyncio.sleep(0)
        assert b.load(2).queued == 2
        b.update(2, [Replica(9, "http://x")], limit=1)
        assert (await waiting[2]).allocation_id == 9
        for task in (waiting[1], late):
            task.cancel()
        await asyncio.gather(*waiting, late, return_exceptions=True)
        assert b.load(1).queued == b.load(2).queued == 0

    asyncio.run(scenario())


def test_token_counts_and_sums_are_bounded_and_deep_json_is_not_parsed() -> None:
    huge = b'{"usage": {"prompt_tokens": 9223372036854775808, "completion_tokens": -3}}'
    assert tokens_in_body(huge) == Tokens(MAX_TOKENS, 0)
    deep = b"[" * 100_000 + b"]" * 100_000
    assert tokens_in_body(b'{"usage": ' + deep + b"}") == Tokens() == tokens_in_body(deep)
    seen = StreamUsage()
    seen.feed(
        _sse(b'{"choices": ' + b"[" * 50_000 + b"]" * 50_000 + b"}") + _sse({"choices": [{"text": "a"}]})
    )
    assert seen.tokens() == Tokens(0, 1)
    book = UsageBook()
    for _ in range(3):
        book.record(1, "u", "tok", "svc", False, Tokens(2**70, 5))
    ((key, count),) = book.take().items()
    assert (count.requests, count.prompt_tokens, count.completion_tokens) == (3, 3 * MAX_TOKENS, 15)
    big = {key: UsageCount(MAX_SUM, 0, MAX_SUM, 0)}
    book.put_back(big)
    book.put_back(big)
    assert book.take()[key].prompt_tokens == MAX_SUM
