"""Sending alert notifications from the outbox: webhooks (signed JSON) and mail.

The rule pass only writes `alert_deliveries` rows; this runs apart from it (its own task, its
own threads), so a receiver that hangs or fails never holds up the rules or the scheduler. Any
replica may send: a delivery is claimed with a compare-and-set before it goes out, so it goes out
once. A failed try is retried with back-off (5 s doubling to 10 min) and given up after ten
tries, kept with the last error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import smtplib
import ssl
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta
from email.message import EmailMessage

import httpx

from computepool.server.alerts.signing import load_or_create_key, signed_headers, webhook_secret
from computepool.server.schemas.alerts import AlertOut, WebhookBody
from computepool.server.settings import ServerSettings
from computepool.store import alerts as store
from computepool.store.db import Database, db_now
from computepool.store.models import Alert

log = logging.getLogger("computepool.server")
BATCH = 64
SEND_THREADS = 8


def alert_out(a: Alert) -> AlertOut:
    return AlertOut(
        id=a.id,
        rule=a.rule,
        state=a.state,  # type: ignore[arg-type]
        severity=a.severity,  # type: ignore[arg-type]
        since=a.since,
        resolved_at=a.resolved_at,
        subject=a.subject,
        tenant=a.tenant,
        summary=a.summary,
        detail=dict(a.detail or {}),
    )


@dataclass(frozen=True)
class Outcome:
    delivery_id: int
    channel: str
    ok: bool
    error: str = ""


@dataclass(frozen=True)
class _Job:
    due: store.Due
    body: WebhookBody


class Notifier:
    """Sends due deliveries; `run_once` is one round (tests call it, with `now` to skip ahead)."""

    def __init__(self, db: Database, settings: ServerSettings) -> None:
        self.db, self.settings = db, settings
        self.timeout_s = 5.0  # per webhook POST or mail conversation
        self.backoff_s = 5.0
        self.max_backoff_s = 600.0
        self.max_attempts = 10
        self.tick_s = 1.0
        self.auto = True
        self._key: bytes | None = None
        self._lock = threading.Lock()
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def key(self) -> bytes:
        if self._key is None:
            self._key = load_or_create_key(self.settings.webhook_key_path)
        return self._key

    def _claim(self, now: datetime | None) -> tuple[datetime, list[_Job]]:
        with self.db.read() as s:  # most rounds find nothing: no write lock taken for that
            at = now or db_now(s)
            if not store.due(s, at, 1):
                return at, []
        with self.db.write() as s:
            claim_until = at + timedelta(seconds=self.timeout_s * 4 + 30)  # a sender that died: retried then
            jobs = []
            for d in store.due(s, at, BATCH):
                if not store.claim(s, d, at, claim_until):
                    continue  # another replica took it
                alert = s.get(Alert, d.alert_id)
                if alert is None:
                    continue
                out = alert_out(alert)
                if d.event == "firing":  # as it was when it fired, even if resolved since
                    out = out.model_copy(update={"state": "firing", "resolved_at": None})
                jobs.append(_Job(d, WebhookBody(event=d.event, alert=out)))  # type: ignore[arg-type]
        return at, jobs

    def run_once(self, now: datetime | None = None) -> list[Outcome]:
        with self._lock:
            at, jobs = self._claim(now)
            if not jobs:
                return []
            with ThreadPoolExecutor(max_workers=min(SEND_THREADS, len(jobs))) as pool:
                outcomes = list(pool.map(self._send, jobs))
            self._record(at, jobs, outcomes)
            return outcomes

    def _send(self, job: _Job) -> Outcome:
        d = job.due
        try:
            if d.channel == "webhook":
                self._post(job)
            else:
                self._mail(job.body)
        except Exception as e:  # every failure is a retry; the reason is kept for `cpool alerts`
            error = f"{type(e).__name__}: {e}"[:500]
            log.warning("alert %d %s notification (%s) failed: %s", d.alert_id, d.event, d.channel, error)
            return Outcome(d.id, d.channel, False, error)
        return Outcome(d.id, d.channel, True)

    def _post(self, job: _Job) -> None:
        d = job.due
        if d.url is None or d.webhook_id is None:
            raise RuntimeError("the webhook was deleted")
        body = job.body.model_dump_json().encode()
        headers = signed_headers(webhook_secret(self.key, d.webhook_id), body)
        with httpx.Client(timeout=self.timeout_s, follow_redirects=False) as client:
            r = client.post(d.url, content=body, headers=headers)
        if not 200 <= r.status_code < 300:
            raise RuntimeError(f"HTTP {r.status_code} from {d.url}")

    def _mail(self, body: WebhookBody) -> None:
        st = self.settings
        if not st.smtp_host or not st.mail_to:
            raise RuntimeError("mail is not set up (smtp_host and mail_to)")
        a = body.alert
        msg = EmailMessage()
        msg["Subject"] = f"[cpool] {body.event.upper()} {a.severity} {a.rule} {a.subject}"
        msg["From"] = st.mail_from
        msg["To"] = ", ".join(st.mail_to)
        lines = [
            a.summary,
            "",
            f"rule: {a.rule}",
            f"state: {body.event}",
            f"severity: {a.severity}",
            f"subject: {a.subject}",
            f"tenant: {a.tenant or '-'}",
            f"since: {a.since.isoformat()}",
        ]
        if body.event == "resolved" and a.resolved_at is not None:
            lines.append(f"resolved at: {a.resolved_at.isoformat()}")
        lines.append(f"detail: {json.dumps(a.detail, sort_keys=True)}")
        msg.set_content("\n".join(lines) + "\n")
        with smtplib.SMTP(st.smtp_host, st.smtp_port, timeout=self.timeout_s) as smtp:
            if st.smtp_starttls:
                smtp.starttls(context=ssl.create_default_context())
            if st.smtp_user:
                password = st.smtp_password_file.read_text().strip() if st.smtp_password_file else ""
                smtp.login(st.smtp_user, password)
            smtp.send_message(msg)

    def _record(self, at: datetime, jobs: list[_Job], outcomes: list[Outcome]) -> None:
        with self.db.write() as s:
            for job, o in zip(jobs, outcomes, strict=True):
                attempts = job.due.attempts + 1
                if o.ok:
                    store.finish(s, o.delivery_id, "sent", attempts, at, "")
                elif attempts >= self.max_attempts:
                    store.finish(s, o.delivery_id, "failed", attempts, at, o.error)
                else:
                    wait = min(self.backoff_s * 2 ** (attempts - 1), self.max_backoff_s)
                    store.finish(s, o.delivery_id, "pending", attempts, at + timedelta(seconds=wait), o.error)

    # --- the loop -----------------------------------------------------------------------------------

    def wake(self) -> None:
        """Send now rather than at the next tick (callable from any thread)."""
        loop, ev = self._loop, self._wake
        if loop is not None and ev is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed
                loop.call_soon_threadsafe(ev.set)

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.tick_s)
            self._wake.clear()
            if not self.auto:
                continue
            try:
                await asyncio.to_thread(self.run_once)
            except Exception:  # the database away: the next round tries again
                log.exception("alert notifications: round failed")

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._task = self._loop.create_task(self._run(), name="cpool-alert-notify")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._loop = None
