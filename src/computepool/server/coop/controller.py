"""The coop controller: measures, plans, places and re-plans each cooperative service.

Every `coop_interval_s`, on the replica holding the scheduling lease (each write fenced by the lease
term, as the service controller's are), for each service whose spec is `cooperative`:

- measuring: a probe allocation on each ready node not measured yet for the model; its result (or
  why it failed) is recorded;
- planning: the planner weighs the measured devices and the links the head node's discovery
  verified, and never picks a split predicted slower than the best single device;
- placing: RPC servers (allocations pinned to their nodes, bound to the verified address); once
  each says it is ready, the service's spec gets the head's command, pinned to the head node, and
  the service controller runs, checks and routes to that replica as to any other;
- running: the replica's real decoding speed is measured once; a split measured slower than the
  best single device is re-planned onto that device (unless the split was forced);
- re-planning: an RPC server that ends, a node lost, or a head replica that fails ends the rest,
  drops the lost node, and plans again (measurements are kept). A spec the user changed is
  planned afresh; a deleted service's RPC servers and probes are ended;
- failed: tried again after min(2**failures, 60) s, at most MAX_ATTEMPTS plans in a row (a plan
  that fails every second would churn allocations); a changed spec starts over.

Each plan has its own secret (CPOOL_COOP_SECRET in its RPC servers' and head's env, never in argv):
llama.cpp's RPC has no authentication, so the engine admits only its holder. Probes and RPC servers
go only where the service's own selector and tolerations let it, and one not started within
PENDING_DEADLINE_S gives its node up for the plan instead of waiting for ever.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from datetime import datetime, timedelta
from typing import Any

from pydantic import ValidationError
from sqlalchemy.orm import Session

from computepool.core.allocation import LIVE, RPC_PORT_ENV
from computepool.server import topics
from computepool.server.coop import measure
from computepool.server.coop.measure import Speed
from computepool.server.coop.place import (
    SECRET_ENV,
    Choice,
    choose,
    fits,
    free_port,
    head_spec,
    peer_refusal,
    public_plan,
    rpc_request,
    shape,
    without_command,
)
from computepool.server.coop.state import Pass as _Pass
from computepool.server.coop.state import (
    RpcShard,
    SpeedCheck,
    State,
    canon,
    empty_public,
    expire_exclusions,
    model_key,
    public,
    same_file,
    waited,
)
from computepool.server.hub import Hub
from computepool.server.leadership import Leadership
from computepool.server.loops import Periodic
from computepool.server.settings import ServerSettings
from computepool.serving.coop import planner
from computepool.store import allocations as alloc_store
from computepool.store import coop as coop_store
from computepool.store import services as svc_store
from computepool.store.db import Database, db_now
from computepool.wire.services import ServiceSpec

log = logging.getLogger("computepool.server")
PORT_COOLDOWN_S = 300.0  # an RPC port whose server ended is not given again for this long
MAX_ATTEMPTS = 8  # plans in a row that failed: then the service waits for a changed spec
MAX_BACKOFF_S = 60.0  # a failed plan is tried again after min(2**failures, this) seconds
PEER_FRESH_S = 90.0  # 3x the agents' refresh of an unchanged peer view: older reports prove nothing
EXCLUSION_S = 60.0  # an excluded node ready again this long (and excluded this long) is used again


class CoopController:
    """Runs `run_once` every `coop_interval_s` on the app's loop; tests set `auto = False` and call it."""

    def __init__(self, db: Database, settings: ServerSettings, hub: Hub, leadership: Leadership) -> None:
        self.db, self.settings, self.hub, self.leadership = db, settings, hub, leadership
        self.auto = True
        self._checks: dict[int, asyncio.Task[None]] = {}  # service id → its running speed check

    async def run_once(self, now: datetime | None = None) -> bool:
        """One pass at `now` (default: the database's clock; tests pass their own); False when this
        replica does not lead."""
        term = self.leadership.term
        if term is None:
            return False
        done = await asyncio.to_thread(self._pass, term, now)
        if done is None:
            return False
        self._wake(done)
        self._checks = {sid: t for sid, t in self._checks.items() if not t.done()}
        for check in done.checks:  # each its own task: one slow replica must not stall every service
            if check.service_id not in self._checks:
                task = asyncio.get_running_loop().create_task(self._check(term, check))
                self._checks[check.service_id] = task
        return True

    async def _check(self, term: int, check: SpeedCheck) -> None:
        try:
            speed = await measure.measure_replica(check.endpoint, check.key, check.tokens)
            await asyncio.to_thread(self._speed_done, term, check, speed)
        except Exception:  # a lost database, …: the next pass checks again
            log.exception("coop controller: speed check of service %d failed", check.service_id)

    # --- the pass -----------------------------------------------------------------------------------
    def _pass(self, term: int, now: datetime | None = None) -> _Pass | None:
        with self.db.write() as s:
            if not self.leadership.holds(s, term):
                return None
            now = now or db_now(s)
            nodes = coop_store.nodes(s)
            fresh = self.settings.suspect_after_s
            ready = {
                n.name
                for n in nodes.values()
                if n.schedulable and (now - n.last_heartbeat_at).total_seconds() < fresh
            }
            alive = {
                n.name
                for n in nodes.values()
                if (now - n.last_heartbeat_at).total_seconds() < self.settings.lost_after_s
            }
            p = _Pass(now, ready, nodes, alive)
            svcs = [v for v in svc_store.list_services(s, None) if v.spec.get("cooperative")]
            ids = {v.id for v in svcs}
            for a in coop_store.live_allocs(s):  # the service is gone (deleted, or no longer cooperative)
                if a.service_id not in ids:
                    self._end(s, p, a.id, "cooperative service deleted or changed")
            rows = coop_store.plans(s, list(ids))
            for svc in svcs:
                try:
                    self._service(s, p, svc, rows.get(svc.id))
                except ValidationError as e:
                    log.warning(
                        "coop controller: service %d: spec unreadable: %s", svc.id, e.errors()[0]["msg"]
                    )
            return p

    def _service(
        self, s: Session, p: _Pass, svc: svc_store.ServiceRow, row: coop_store.PlanRow | None
    ) -> None:
        spec = ServiceSpec.model_validate(svc.spec)
        coop = spec.cooperative
        assert coop is not None
        st = State.of(row)
        pub = empty_public() | public(row)
        attempt = row.attempt if row else 0
        status = row.status if row else "measuring"
        reason = row.reason if row else ""
        if st.written != canon(svc.spec):  # created, or changed by its user: plan afresh
            self._end_all(s, p, st, "spec changed: re-planning")
            st, pub, attempt, status = (
                State(written=canon(svc.spec)),
                empty_public(),
                attempt + 1,
                "measuring",
            )
            reason = "measuring"
        expire_exclusions(st, p.ready, p.now, EXCLUSION_S)
        if status == "failed":  # tried again after a back-off, at most MAX_ATTEMPTS times in a row
            wait = min(2.0**st.failures, MAX_BACKOFF_S)
            since = (p.now - row.updated_at).total_seconds() if row else wait
            if st.failures >= MAX_ATTEMPTS or since < wait:
                return self._save(s, p, svc.id, row, "failed", reason, attempt, pub, st)
            attempt += 1
        if status in ("measuring", "replanning", "failed"):
            status, reason, pub = self._plan(s, p, svc, spec, st, pub)
            if status == "failed":
                st.failures += 1
                if st.failures >= MAX_ATTEMPTS:
                    reason = (
                        f"gave up after {st.failures} failed plans (last: {reason}); change the spec to retry"
                    )
        if status in ("starting", "running"):
            status, reason, attempt = self._follow(s, p, svc, spec, st, pub, status, attempt)
        self._save(s, p, svc.id, row, status, reason, attempt, pub, st)

    # --- measuring and planning ------------------------------------------------------------------
    def _plan(
        self,
        s: Session,
        p: _Pass,
        svc: svc_store.ServiceRow,
        spec: ServiceSpec,
        st: State,
        pub: dict[str, object],
    ) -> tuple[str, str, dict[str, object]]:
        coop = spec.cooperative
        assert coop is not None
        key = model_key(coop, svc.tenant_id)
        usable = sorted(
            n
            for n in p.ready
            if n not in st.excluded and n not in st.unusable and fits(p.nodes[n], spec.request)
        )
        known, pending = self._measure(s, p, svc, spec, st, key, usable)
        if pending:
            return "measuring", f"measuring the model on {', '.join(pending)}", pub
        measured = {n: m for n, m in known.items() if n in usable}
        notes = {**{n: "not admitted by the service's node selector or tolerations"
                    for n in p.ready if not fits(p.nodes[n], spec.request)},
                 **{n: f"unusable: {w}" for n, w in st.unusable.items()},
                 **{n: f"excluded: {w}" for n, w in st.excluded.items()}}  # fmt: skip
        if not measured:
            why = "; ".join(f"{n}: {w}" for n, w in sorted(notes.items())) or "no ready node"
            return "failed", f"no node can run the model ({why})"[:1000], pub
        model = shape(next(iter(measured.values())).detail)
        peers, refused = self._peers(s, p, measured)
        choice = choose(coop, model, measured, peers, single_only=st.single_only is not None)
        new = public_plan(choice, measured, p.nodes, notes, model)
        chosen = choice.plan.chosen
        if chosen is None or choice.head is None:
            return "failed", choice.plan.reason or "the planner chose nothing", new
        refusals = f"peer addresses not used: {'; '.join(refused)}" if refused else ""
        st.plan_reason = "; ".join(
            w for w in (choice.plan.reason, choice.why, st.single_only or "", refusals) if w
        )
        st.secret = secrets.token_hex(32)  # a new plan, a new secret
        st.head = choice.head
        st.best_single_tps = (
            choice.plan.best_single.predicted_tokens_per_s if choice.plan.best_single else None
        )
        failure = self._place_rpc_servers(s, p, svc, spec, st, choice, peers, new)
        if failure is not None:
            return "failed", failure, new
        st.split = bool(st.rpc)
        waiting = f"starting RPC servers on {', '.join(r.node for r in st.rpc)}" if st.rpc else "starting"
        return "starting", f"{waiting}: {st.plan_reason}", new

    def _measure(
        self,
        s: Session,
        p: _Pass,
        svc: svc_store.ServiceRow,
        spec: ServiceSpec,
        st: State,
        key: str,
        usable: list[str],
    ) -> tuple[dict[str, coop_store.Measurement], list[str]]:
        """The model's measurements on the usable nodes, probing those not measured yet: (what is
        known, the nodes still being measured)."""
        coop = spec.cooperative
        assert coop is not None
        known = same_file({m.node: m for m in coop_store.measurements(s, key) if m.device == "cpu"}, st)
        size = next((int(m.detail.get("model_bytes") or 0) for m in known.values()), 0)
        probes = coop_store.allocs_by_id(s, list(st.probes.values()))
        pending: list[str] = []
        for n in usable:
            if n in known:
                continue
            pid = st.probes.get(n)
            a = probes.get(pid) if pid is not None else None
            if a is None:
                mib = measure.probe_memory_mib(size, p.nodes[n].memory_mib)
                req = measure.probe_request(coop, spec.request, n, mib, svc.tenant, svc.name)
                st.probes[n] = self._insert(s, svc, "probe", req, None, p)
                pending.append(n)
            elif self._probe_outcome(s, p, st, key, n, a, known):
                pending.append(n)
        checked = same_file(known, st)  # a file differing from one measured in this pass: probed again
        pending += [n for n in usable if n in known and n not in checked and n not in st.unusable]
        return checked, pending

    def _probe_outcome(
        self,
        s: Session,
        p: _Pass,
        st: State,
        key: str,
        n: str,
        a: coop_store.CoopAlloc,
        known: dict[str, coop_store.Measurement],
    ) -> bool:
        """What node `n`'s probe `a` says: a measurement (into `known`), a reason the node is
        unusable, or nothing yet (True: still measuring)."""
        if a.state in ("pending", "bound") and waited(p.now, a) > measure.PENDING_DEADLINE_S:
            self._end(s, p, a.id, f"not started within {measure.PENDING_DEADLINE_S:g} s")
            st.unusable[n] = f"its probe was not started within {measure.PENDING_DEADLINE_S:g} s"
            st.probes.pop(n, None)
            return False
        if a.state in LIVE:
            return True
        result = measure.probe_result(coop_store.stdout_of(s, a.id))
        late = a.ended_at is not None and (p.now - a.ended_at).total_seconds() < measure.LOG_GRACE_S
        if result is not None:
            m = measure.measurement(n, p.nodes[n].memory_mib, result, p.now)
            coop_store.put_measurement(s, key, m)
            known[n] = m
            st.probes.pop(n, None)
            return False
        if a.state == "released" and late:
            return True  # its last output may still be on its way
        st.unusable[n] = measure.failure(a.state, a.reason, coop_store.stderr_tail(s, a.id))
        st.probes.pop(n, None)
        return False

    @staticmethod
    def _peers(
        s: Session, p: _Pass, measured: dict[str, coop_store.Measurement]
    ) -> tuple[list[coop_store.PeerRow], list[str]]:
        """The verified, fresh peer links between measured nodes; and why others are not used."""
        fresh = p.now - timedelta(seconds=PEER_FRESH_S)
        peers: list[coop_store.PeerRow] = []
        refused: list[str] = []
        for pr in coop_store.verified_peers(s, list(measured), fresh):
            refusal = peer_refusal(pr, p.nodes)
            if refusal is None:
                peers.append(pr)
            elif pr.node_id in measured:
                refused.append(refusal)
        return peers, refused

    def _place_rpc_servers(
        self,
        s: Session,
        p: _Pass,
        svc: svc_store.ServiceRow,
        spec: ServiceSpec,
        st: State,
        choice: Choice,
        peers: list[coop_store.PeerRow],
        new: dict[str, object],
    ) -> str | None:
        """An RPC server allocation per RPC shard of the chosen plan, each on a free port at the
        address the head saw it at; the reason when there is no port left."""
        coop = spec.cooperative
        assert coop is not None and choice.plan.chosen is not None
        by_node = {pr.node_id: pr for pr in peers if pr.observer == choice.head}
        used = coop_store.used_rpc_ports(s, p.now - timedelta(seconds=PORT_COOLDOWN_S))
        lo, hi = self.settings.rpc_port_min, self.settings.rpc_port_max
        shards = list(new["shards"])  # type: ignore[call-overload]
        for sh, planned in zip(shards, choice.plan.chosen.shards, strict=True):
            if planned.role != "rpc":
                continue
            port = free_port(used, lo, hi)
            if port is None:
                self._end_all(s, p, st, "no RPC port free")
                return f"every RPC port {lo}-{hi} is taken"
            used.add(port)
            address = by_node[planned.node].address
            req = rpc_request(coop, spec.request, planned.node, address, port, planned.memory_mib,
                              svc.tenant, svc.name)  # fmt: skip
            env = {RPC_PORT_ENV: str(port), SECRET_ENV: st.secret or ""}
            alloc = self._insert(s, svc, "rpc", req, env, p)
            endpoint = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
            st.rpc.append(RpcShard(alloc, planned.node, endpoint))
            sh["endpoint"] = endpoint
        new["shards"] = shards
        return None

    # --- placing and following ---------------------------------------------------------------------
    def _follow(
        self,
        s: Session,
        p: _Pass,
        svc: svc_store.ServiceRow,
        spec: ServiceSpec,
        st: State,
        pub: dict[str, object],
        status: str,
        attempt: int,
    ) -> tuple[str, str, int]:
        """A placed plan: re-planned when one of its parts failed, else its head started or followed."""
        trouble = self._rpc_trouble(s, p, st)
        if trouble is not None:
            why, exclude = trouble
            return self._replan(s, p, svc, st, why, exclude, attempt)
        if st.head_generation is None:
            return "starting", self._start_head(s, p, svc, spec, st, pub), attempt
        return self._follow_head(s, p, svc, spec, st, status, attempt)

    @staticmethod
    def _rpc_trouble(s: Session, p: _Pass, st: State) -> tuple[str, dict[str, str]] | None:
        """Why the plan must be made again (a node lost, an RPC server ended or never started),
        with the nodes to leave out of the next one; None while its RPC servers are well."""
        lost = sorted(n for n in {st.head, *(r.node for r in st.rpc)} if n is not None and n not in p.alive)
        if lost:
            return f"node {', '.join(lost)} lost", {n: "node lost" for n in lost}
        allocs = coop_store.allocs_by_id(s, [r.alloc for r in st.rpc])
        for r in st.rpc:
            a = allocs.get(r.alloc)
            if a is None or a.state not in LIVE:
                state, why = (a.state, a.reason) if a else ("gone", "")
                text = f"RPC server on {r.node} {state}" + (f" ({why})" if why else "")
                return text, {r.node: text}
            if not r.ready and a.state == "active":
                r.ready = measure.RPC_READY_LINE in coop_store.stdout_of(s, a.id)
            if a.state in ("pending", "bound") and waited(p.now, a) > measure.PENDING_DEADLINE_S:
                text = f"RPC server on {r.node} not started within {measure.PENDING_DEADLINE_S:g} s"
                return text, {r.node: text}
        return None

    def _start_head(
        self,
        s: Session,
        p: _Pass,
        svc: svc_store.ServiceRow,
        spec: ServiceSpec,
        st: State,
        pub: dict[str, object],
    ) -> str:
        """Once every RPC server is ready: the service's spec becomes the head's (a new generation),
        which the service controller then runs as its replica. The plan's reason."""
        waiting = [r.node for r in st.rpc if not r.ready]
        if waiting:
            return f"waiting for RPC servers on {', '.join(waiting)}: {st.plan_reason}"
        assert st.head is not None
        if st.secret is None:  # a plan stored before plans had secrets
            st.secret = secrets.token_hex(32)
        shards = [_shard(sh) for sh in pub["shards"]]  # type: ignore[attr-defined]
        address = p.nodes[st.head].address or "127.0.0.1"
        endpoints = [r.endpoint for r in st.rpc]
        new = head_spec(spec, svc.name, st.head, address, shards, endpoints, st.secret)
        svc_store.set_spec(s, svc.id, new, svc.generation + 1, p.now)
        st.written, st.head_generation, st.head_written_at = canon(new), svc.generation + 1, p.now.isoformat()
        p.services.append(svc.id)
        return f"head replica starting on {st.head}: {st.plan_reason}"

    def _follow_head(
        self,
        s: Session,
        p: _Pass,
        svc: svc_store.ServiceRow,
        spec: ServiceSpec,
        st: State,
        status: str,
        attempt: int,
    ) -> tuple[str, str, int]:
        """The head replica: failed (re-plan), not ready yet, or running (its speed checked once)."""
        assert st.head_generation is not None
        since = datetime.fromisoformat(st.head_written_at) if st.head_written_at else p.now
        failed = [f for f in svc_store.failed_since(s, since) if f[1] == svc.id]
        if failed:
            # A head that lost a peer exits at once, maybe before that RPC server's own end reaches
            # the server: wait a little for it, so that the lost node is left out of the next plan.
            first = min(f[3] for f in failed)
            if st.rpc and (p.now - first).total_seconds() < measure.LOG_GRACE_S:
                return "starting", "head replica failed: checking its RPC servers before re-planning", attempt
            return self._replan(
                s, p, svc, st, f"head replica {failed[0][0]} failed ({failed[0][2]})", {}, attempt
            )
        reps = [r for r in svc_store.replicas(s, [svc.id]) if r.generation >= st.head_generation]
        ready = [r for r in reps if r.state == "active" and r.replica_state == "ready"]
        if not ready:
            if status == "running":
                return "starting", f"head replica restarting on {st.head}: {st.plan_reason}", attempt
            return "starting", f"head replica starting on {st.head}: {st.plan_reason}", attempt
        if not st.speed_checked and ready[0].endpoint:
            coop = spec.cooperative
            assert coop is not None
            p.checks.append(SpeedCheck(svc.id, attempt, ready[0].endpoint, ready[0].key, coop.probe_tokens))
        st.failures = 0
        kind = f"split over {len(st.rpc) + 1} nodes" if st.rpc else f"on {st.head} alone"
        return "running", f"running {kind}: {st.plan_reason}".rstrip(": "), attempt

    def _replan(
        self,
        s: Session,
        p: _Pass,
        svc: svc_store.ServiceRow,
        st: State,
        why: str,
        exclude: dict[str, str],
        attempt: int,
    ) -> tuple[str, str, int]:
        """End what is left of the plan and plan again without the lost nodes (measurements kept)."""
        self._end_all(s, p, st, f"re-planning: {why}")
        st.excluded.update(exclude)
        st.excluded_at.update({n: p.now.isoformat() for n in exclude})
        for n in exclude:
            st.ready_since.pop(n, None)
        st.speed_checked, st.split = False, False
        st.failures += 1
        if svc.spec.get("request", {}).get("command"):  # no head until the new plan is placed
            new = without_command(svc.spec)
            svc_store.set_spec(s, svc.id, new, svc.generation + 1, p.now)
            st.written = canon(new)
            p.services.append(svc.id)
        log.info("coop service %d: re-planning (%s)", svc.id, why)
        if st.failures >= MAX_ATTEMPTS:
            return (
                "failed",
                f"gave up after {st.failures} plans in a row that did not run (last: {why}); change the "
                "spec to retry",
                attempt,
            )
        return "replanning", why, attempt + 1

    # --- the running plan's speed ----------------------------------------------------------------
    def _speed_done(self, term: int, check: SpeedCheck, speed: Speed) -> None:
        with self.db.write() as s:
            if not self.leadership.holds(s, term):
                return
            row = coop_store.plans(s, [check.service_id]).get(check.service_id)
            svc = svc_store.by_ids(s, [check.service_id]).get(check.service_id)
            if row is None or svc is None or row.status != "running" or row.attempt != check.attempt:
                return
            st, pub = State.of(row), empty_public() | public(row)
            if st.speed_checked:
                return
            st.speed_checked = True
            pub["measured_tokens_per_s"] = speed.tokens_per_s
            reason, status, attempt = row.reason, row.status, row.attempt
            spec = ServiceSpec.model_validate(svc.spec)
            forced = spec.cooperative is not None and spec.cooperative.force_split is not None
            best = st.best_single_tps
            now = db_now(s)
            p = _Pass(now, set(), {})
            if speed.tokens_per_s is None:
                reason = f"{row.reason}; speed not measured: {speed.detail}"
            elif st.split and not forced and best is not None and speed.tokens_per_s < best:
                st.single_only = (
                    f"the split measured {speed.tokens_per_s:.1f} tokens/s, slower than the best single "
                    f"device's {best:.1f}: single devices only"
                )
                status, reason, attempt = self._replan(s, p, svc, st, st.single_only, {}, row.attempt)
                pub["measured_tokens_per_s"] = None
            self._save(s, p, svc.id, row, status, reason, attempt, pub, st)
        self._wake(p)

    # --- writes ------------------------------------------------------------------------------------
    def _save(
        self,
        s: Session,
        p: _Pass,
        sid: int,
        row: coop_store.PlanRow | None,
        status: str,
        reason: str,
        attempt: int,
        pub: dict[str, object],
        st: State,
    ) -> None:
        plan = {"public": pub, "state": st.dump()}
        if row is not None and (row.status, row.reason, row.attempt, canon(row.plan)) == (
            status,
            reason[:4000],
            attempt,
            canon(plan),
        ):
            return
        coop_store.put_plan(s, sid, status, plan, reason[:4000], attempt, p.now)

    def _end_all(self, s: Session, p: _Pass, st: State, why: str) -> None:
        """End the plan's RPC servers and probes and forget them (and the head, and the secret)."""
        for r in st.rpc:
            self._end(s, p, r.alloc, why)
        for pid in st.probes.values():
            self._end(s, p, pid, why)
        st.probes.clear()
        st.rpc, st.head, st.head_generation, st.head_written_at, st.secret = [], None, None, None, None

    @staticmethod
    def _insert(
        s: Session,
        svc: svc_store.ServiceRow,
        role: str,
        req: dict[str, Any],
        env: dict[str, str] | None,
        p: _Pass,
    ) -> int:
        alloc = coop_store.insert_alloc(
            s, service_id=svc.id, tenant_id=svc.tenant_id, owner=svc.owner, name=str(req["name"]),
            role=role, request=req, env=env, now=p.now,
        )  # fmt: skip
        p.started.append(alloc)
        return alloc

    @staticmethod
    def _end(s: Session, p: _Pass, alloc_id: int, why: str) -> None:
        head = alloc_store.lock_head(s, alloc_id)
        if head is None or head.state not in LIVE:
            return
        alloc_store.end(s, head, "cancelled", why, p.now)
        p.ended.append(alloc_id)
        p.ended_nodes.update(head.nodes)

    def _wake(self, p: _Pass) -> None:
        keys = [*topics.nodes(p.ended_nodes), *topics.ended(p.ended)]
        keys += [topics.service(i) for i in p.services]
        if keys:
            self.hub.notify(*keys)
        if p.started or p.ended:
            self.hub.wake_scheduler()

    # --- the loop --------------------------------------------------------------------------------
    def periodic(self) -> Periodic:
        return Periodic("coop", self.settings.coop_interval_s, self.run_once, enabled=lambda: self.auto)

    async def stop(self) -> None:
        """Cancel the speed checks still running (after the loops have stopped)."""
        for task in self._checks.values():
            task.cancel()
        self._checks.clear()


def _shard(d: dict[str, object]) -> planner.Shard:
    fields = {k: v for k, v in d.items() if k in planner.Shard.__dataclass_fields__}
    return planner.Shard(**fields)  # type: ignore[arg-type]
