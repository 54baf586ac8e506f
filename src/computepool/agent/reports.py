"""What the agent tells the control plane about its jobs: `running`, then how each attempt ended.

Starts are held in memory until acknowledged, ends in LocalState (written before they are sent), so
an end seen while the control plane is away is reported when it answers again. An acknowledged end
is forgotten once an assignments answer asked for after the acknowledgement no longer lists it
(`forget_done`): until then its record is what keeps the attempt from being started again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Container, Iterator
from datetime import UTC, datetime
from typing import Any

from computepool.agent import fencing
from computepool.agent.api import AgentApi, ApiError
from computepool.agent.assignment import wire_id
from computepool.agent.executor import Executor
from computepool.agent.localstate import JobRecord, JobState, job_key

log = logging.getLogger("computepool.agent")


def _iso(ts: float | None) -> str | None:
    return None if not ts else datetime.fromtimestamp(ts, UTC).isoformat()


def report_body(rec: JobRecord) -> dict[str, Any]:
    """The control plane's words: `exited` with the exit code when the process ended by itself,
    `failed` when it could not start or was stopped (reason says why), `lost` when unknown."""
    exited = rec.state is JobState.SUCCEEDED or (
        rec.state is JobState.FAILED and rec.exit_code is not None and rec.reason.startswith("exit code")
    )
    if rec.state is JobState.RUNNING:
        state = "running"
    elif rec.state is JobState.LOST:
        state = "lost"
    else:
        state = "exited" if exited else "failed"
    body: dict[str, Any] = {
        "allocation_id": wire_id(rec.allocation_id),
        "attempt": rec.attempt,
        "state": state,
    }
    if rec.started_at:
        body["started_at"] = _iso(rec.started_at)
    port = rec.extra.get("master_port", "")
    if state == "running" and port.isdigit():  # rank 0 of a gang: the master port it offers
        body["master_port"] = int(port)
    if state == "running" and rec.extra.get("image_id"):  # the id an unpinned image name gave here
        body["image_digest"] = rec.extra["image_id"]
    if rec.state.ended:
        body["ended_at"] = _iso(rec.ended_at or time.time())
        body["reason"] = (rec.reason or f"exit code {rec.exit_code}")[:1000]
        if rec.exit_code is not None:
            body["exit_code"] = rec.exit_code
    return body


class Reporter:
    """The job states the control plane has yet to hear, and sending them (one batch, else one by one)."""

    def __init__(self, api: AgentApi, executor: Executor, refused: Callable[[str, ApiError], None]) -> None:
        self.api = api
        self.executor = executor
        self.state = executor.state
        self.refused = refused
        self.running_unreported: set[str] = set()
        # who listens on each running replica's port (listeners.py): sent again whenever it changes
        self.listeners: Callable[[], dict[str, str]] = dict
        self._listener_sent: dict[str, str] = {}
        # acknowledged ends still kept, with when (CLOCK_BOOTTIME); those of an earlier run: at 0
        self.acknowledged: dict[str, float] = dict.fromkeys(self.state.acknowledged(), 0.0)

    def pending(self) -> Iterator[tuple[str, dict[str, Any], JobRecord]]:
        found = self.listeners()
        for key in list(self._listener_sent):
            if key not in found:
                del self._listener_sent[key]
        changed = {k for k, v in found.items() if v != self._listener_sent.get(k)}
        for key in sorted(self.running_unreported | changed):
            rec = self.executor.get(key)
            if rec is not None and rec.state is JobState.RUNNING:
                body = report_body(rec)
                if key in found:
                    body["listener"] = found[key]
                yield key, body, rec
        for rec in self.state.unreported():
            yield rec.key, report_body(rec), rec

    def send(self, output_unsent: Container[str]) -> set[str]:
        """Report starts and ends (raises Unreachable); an end waits until its output is all sent
        (its key is not in `output_unsent`). Answers the keys the control plane called stale."""
        pending = [p for p in self.pending() if p[2].state is JobState.RUNNING or p[0] not in output_unsent]
        if not pending:
            return set()
        try:
            answer = self.api.report([body for _, body, _ in pending])
        except ApiError as e:
            if e.status == 401:
                self.refused("reports", e)
                return set()
            answer = self._one_by_one(pending)
        for key, body, rec in pending:
            self._acknowledged(key, rec)
            if "listener" in body:
                self._listener_sent[key] = body["listener"]
        return {job_key(str(s["allocation_id"]), int(s["attempt"])) for s in answer.get("stale") or []}

    def _one_by_one(self, pending: list[tuple[str, dict[str, Any], JobRecord]]) -> dict[str, Any]:
        """A refused batch: send each alone so that one bad report cannot block the others forever."""
        stale: list[Any] = []
        for _key, body, _rec in pending:
            try:
                stale += self.api.report([body]).get("stale") or []
            except ApiError as e:
                log.warning("report %s #%s refused, dropped: %s", body["allocation_id"], body["attempt"], e)
        return {"stale": stale}

    def _acknowledged(self, key: str, rec: JobRecord) -> None:
        if rec.state is JobState.RUNNING:
            self.running_unreported.discard(key)
        else:
            self.state.mark_reported(key)
            self.acknowledged[key] = fencing.now_s()

    def forget_done(self, desired: Collection[str], sent: float) -> list[str]:
        """Forget the acknowledged ends that an assignments answer asked for at `sent` (CLOCK_BOOTTIME),
        after their acknowledgement, no longer lists: the pool is done with them. One still listed
        is kept, so that it is never started again here. Returns the keys forgotten."""
        gone = [k for k, at in self.acknowledged.items() if at < sent and k not in desired]
        if gone:
            self.state.forget_many(gone)
            for key in gone:
                del self.acknowledged[key]
        return gone
