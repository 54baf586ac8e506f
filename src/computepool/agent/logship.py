"""Shipping each job's stdout and stderr to the control plane in chunks, resumable after a restart.

Where shipping stands is saved in the run dir (LOG_OFFSETS_FILE), so a restarted agent neither
loses nor doubles output; a job's end is reported only once its output is all sent.

The job holds descriptors to its log files, so their size is its to choose: `ftruncate` makes a
1 TiB file of nothing at once. The control plane keeps the last `log_max_mib` of each attempt's
stream (it says so in each heartbeat answer), so a stream's unsent part past that is skipped here,
one line saying how much, rather than shipped to be dropped there.

One tick sends at most `TICK_CHUNKS` chunks, the tenants taking turns (a tenant's jobs in turn
too, where the last tick left off): many jobs of one tenant printing at full speed made every tick
ship all of them before another tenant's job's last line, whose end waits for it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from computepool.agent.api import AgentApi, ApiError
from computepool.agent.assignment import wire_id
from computepool.agent.executor import Executor
from computepool.agent.jobspec import STDERR_LOG, STDOUT_LOG
from computepool.agent.localstate import JobRecord

log = logging.getLogger("computepool.agent")

LOG_OFFSETS_FILE = "log-offsets.json"
STREAMS = (("stdout", STDOUT_LOG), ("stderr", STDERR_LOG))
_LINE_ROOM = 256  # the line saying what was skipped is shorter
TICK_CHUNKS = 32  # chunks sent per tick, all jobs together
CHUNKS_PER_TURN = 4  # per stream of a job, before the next tenant's turn


@dataclass
class _LogTail:
    """Where the shipping of one attempt's stdout/stderr stands; persisted in its run dir.

    Per stream: the byte position read up to in the log file, and the stream offset the control
    plane counts in (UTF-8 bytes of the text sent). They differ only where the output was not valid
    UTF-8 and a replacement character went out instead.
    """

    allocation_id: str
    attempt: int
    run_dir: Path
    tenant: str = ""
    read_pos: dict[str, int] = field(default_factory=lambda: {"stdout": 0, "stderr": 0})
    sent: dict[str, int] = field(default_factory=lambda: {"stdout": 0, "stderr": 0})
    done: bool = False

    @classmethod
    def load(cls, rec: JobRecord) -> _LogTail:
        tail = cls(rec.allocation_id, rec.attempt, Path(rec.run_dir), rec.extra.get("tenant", ""))
        with contextlib.suppress(OSError, ValueError, TypeError):
            data = json.loads((tail.run_dir / LOG_OFFSETS_FILE).read_text())
            tail.read_pos = {s: int(data[s][0]) for s, _ in STREAMS}
            tail.sent = {s: int(data[s][1]) for s, _ in STREAMS}
            tail.done = bool(data.get("done", False))
        return tail

    def save(self) -> None:
        path = self.run_dir / LOG_OFFSETS_FILE
        tmp = path.with_suffix(".tmp")
        data: dict[str, Any] = {s: [self.read_pos[s], self.sent[s]] for s, _ in STREAMS}
        with contextlib.suppress(OSError):
            tmp.write_text(json.dumps({**data, "done": self.done}))
            os.replace(tmp, path)


def _utf8_chunk(raw: bytes, final: bool) -> tuple[bytes, str]:
    """Cut `raw` at a character boundary (unless it is the last of the file) and decode it. A NUL
    goes out as U+FFFD, as undecodable bytes do: the control plane's text columns hold no NUL."""
    try:
        text = raw.decode()
    except UnicodeDecodeError as e:
        if not final and e.reason == "unexpected end of data" and e.start > 0:
            raw = raw[: e.start]
        text = raw.decode(errors="replace")
    return raw, text.replace("\x00", "\ufffd")


class LogShipper:
    """The output of each job not yet all sent (its tail), and sending it a few chunks per tick."""

    def __init__(
        self,
        api: AgentApi,
        executor: Executor,
        chunk_bytes: int,
        refused: Callable[[str, ApiError], None],
        send: Callable[[int | str, int, str, int, str], object] | None = None,
    ) -> None:
        """`send`: how a chunk goes out (the control plane's logs route; a test may watch it)."""
        self.api = api
        self.executor = executor
        self.chunk_bytes = chunk_bytes
        self.refused = refused
        self.send = send or api.logs
        self.tails: dict[str, _LogTail] = {}
        self.cap_bytes: int | None = None  # what the control plane keeps of a stream (None: not said)
        # a job may start before the first heartbeat is answered: what it wrote by then past the cap
        # would be shipped, to be dropped there
        self.answered = False
        self._served: dict[str, int] = {}  # tenant: the tick its turn last came (who goes first next)
        self._ticks = 0

    def learn_cap(self, log_max_mib: Any) -> None:
        """The control plane's `log_max_mib`, from a heartbeat answer (one without it changes nothing
        but that an answer came: nothing is shipped before the first, which says the cap)."""
        self.answered = True
        if isinstance(log_max_mib, int) and log_max_mib > 0:
            self.cap_bytes = log_max_mib << 20

    def track(self, rec: JobRecord) -> None:
        if rec.key not in self.tails:
            self.tails[rec.key] = _LogTail.load(rec)

    def resume(self, recs: Iterable[JobRecord]) -> None:
        """Take up the jobs whose output was not all sent when the agent last stopped."""
        for rec in recs:
            if rec.key not in self.tails:
                tail = _LogTail.load(rec)
                if not tail.done:
                    self.tails[rec.key] = tail

    def _turns(self) -> list[str]:
        """The tails' keys, one of each tenant in turn, the tenant served longest ago first; within a
        tenant, its tails in order (a tail left unsent moves to the back once it had its turn)."""
        by_tenant: dict[str, list[str]] = {}
        for key, tail in self.tails.items():
            by_tenant.setdefault(tail.tenant, []).append(key)
        tenants = sorted(by_tenant, key=lambda t: self._served.get(t, -1))
        order: list[str] = []
        for i in range(max((len(v) for v in by_tenant.values()), default=0)):
            order += [by_tenant[t][i] for t in tenants if i < len(by_tenant[t])]
        return order

    def ship(self) -> None:
        """Send what the jobs wrote since the last offset, `TICK_CHUNKS` at most (raises
        Unreachable); a tail is done once its job ended and all its output is sent."""
        if not self.answered:
            return
        self._ticks += 1
        budget = TICK_CHUNKS
        for key in self._turns():
            if budget <= 0:
                break
            tail = self.tails[key]
            self._served[tail.tenant] = self._ticks
            rec = self.executor.get(key)
            ended = rec is None or rec.state.ended
            try:
                complete, used = self._ship_tail(tail, final=ended, budget=budget)
            except ApiError as e:
                if e.status == 401:
                    self.refused("logs", e)
                    return
                # another attempt is current, or the allocation is not ours: this output has no home
                log.warning("logs of %s refused, no longer sent: %s", key, e)
                complete, ended, used = True, True, 1
            budget -= used
            del self.tails[key]
            if complete and ended:
                tail.done = True
                tail.save()
            else:
                self.tails[key] = tail  # to the back of its tenant's turn
        for gone in set(self._served) - {t.tenant for t in self.tails.values()}:
            del self._served[gone]

    def _ship_tail(self, tail: _LogTail, final: bool, budget: int = TICK_CHUNKS) -> tuple[bool, int]:
        """Send new output of both streams (`CHUNKS_PER_TURN` chunks of each at most, `budget` in
        all); whether all is sent, and how many chunks went.

        A chunk resent after a crash (offset below the server's end) is trimmed by the server.
        """
        complete, used = True, 0
        for stream, filename in STREAMS:
            path = tail.run_dir / filename
            for _ in range(CHUNKS_PER_TURN):
                if used >= budget:
                    return False, used
                pos = tail.read_pos[stream]
                try:
                    with open(path, "rb") as f:
                        pos = self._skip_past_cap(tail, stream, os.fstat(f.fileno()).st_size)
                        f.seek(pos)
                        raw = f.read(self.chunk_bytes)
                        at_eof = not f.read(1)
                except FileNotFoundError:
                    break
                raw, text = _utf8_chunk(raw, final and at_eof)
                if not raw:
                    break
                self.send(wire_id(tail.allocation_id), tail.attempt, stream, tail.sent[stream], text)
                used += 1
                tail.read_pos[stream] = pos + len(raw)
                tail.sent[stream] += len(text.encode())
                tail.save()
                if at_eof:
                    break
            else:
                complete = False
        return complete, used

    def _skip_past_cap(self, tail: _LogTail, stream: str, size: int) -> int:
        """Where to read on: past all but the last `cap_bytes` of the unsent part, which the control
        plane would drop (a line sent in their place says how many bytes went)."""
        pos = tail.read_pos[stream]
        if self.cap_bytes is None or size - pos <= self.cap_bytes:
            return pos
        skipped = size - (self.cap_bytes - _LINE_ROOM) - pos  # the line and what follows fit the cap
        line = f"[cpool: {skipped} bytes of this attempt's {stream} dropped on the node: over the log cap]\n"
        self.send(wire_id(tail.allocation_id), tail.attempt, stream, tail.sent[stream], line)
        tail.read_pos[stream] = pos + skipped
        tail.sent[stream] += len(line.encode())
        tail.save()
        return tail.read_pos[stream]
