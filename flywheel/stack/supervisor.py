"""`flywheel up`: the whole local stack on one machine, supervised.

The supervisor starts what is not configured externally (a local Postgres with data under
`<home>/pg`, the bundled broker), runs migrations, creates topics, then runs every service
as a child process (ingest, miner, …, outbox relay, API). It keeps all of it running:

* a service that dies is restarted, with backoff (`supervise.Backoff`);
* Postgres that dies is restarted the same way (services retry meanwhile; ingest fails
  its batch, is restarted and gets the batch redelivered: nothing is lost);
* the broker that dies is restarted and its topics recreated (`heal.Healer`, which the
  `Stack` holds: it owns the broker's and Postgres's state); the Kafka
  consumers are stopped first and started afresh afterwards (a consumer that kept its old
  position would skip the new broker's first records), and what Postgres holds of what it
  may have taken with it — outbox events, stored but unmined trajectories — is republished
  (`recovery`); trajectories it held that ingest had not stored are lost, and reported;
* past `stack.broker_max_rss_mb` the broker is drained and replaced (it deletes nothing);
* every log under `<home>/logs` is rotated by size (`logs`);
* with the `vllm` engine and no replica configured, a local vLLM server (given by the
  caller, built by `flywheel.policy.vllm_flags`) is started first and the services are
  pointed at it; it is stopped last.

`<home>/run.json` (mode 0600) is its report: where everything is, and per component its
state, pid, restarts and last error; `flywheel status` and the API read it. SIGUSR1 asks
for a repair now (backoffs reset); SIGTERM/SIGINT stop the stack after draining it
(`drain`), as `<home>/stop-request.json` asks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from flywheel.config import Settings, settings_env
from flywheel.runtime.endpoints import read_run, run_file
from flywheel.runtime.kafka import consumer_groups
from flywheel.runtime.logs import mask_text, rotate_if_needed
from flywheel.runtime.losses import KeyTail, arrived, count_loss, loss_view, unstored_total
from flywheel.stack.broker import MEMORY_ONLY_NOTE, LocalBroker
from flywheel.stack.drain import close_intake, drain, read_positions, reopen_intake
from flywheel.stack.heal import Healer
from flywheel.stack.launch import (
    LAST_STOP,
    SERVICES,
    STOP_REQUEST,
    load_or_make_tokens,
    operate_token,
    service_argv,
    torch_threads,
    write_json_private,
)
from flywheel.stack.postgres import LocalPostgres
from flywheel.stack.processes import (
    Backoff,
    Service,
    become_subreaper,
    pid_alive,
    reap_orphans,
    run_sync,
)
from flywheel.stack.vllm_server import VLLMServer

log = logging.getLogger("flywheel.up")


class Stack:
    def __init__(self, settings: Settings, vllm: VLLMServer | None = None) -> None:
        self.settings = settings
        self.vllm = vllm
        self.home = settings.home.resolve()
        self.logs = self.home / "logs"
        cap = settings.stack.restart_backoff_max_s
        self.services = [Service(n, [], self.logs / f"{n}.log", Backoff(cap))
                         for n in SERVICES]
        self.env: dict[str, str] = {}
        self.status = "starting"
        self.notes: list[str] = []
        self.healer = Healer(settings, self.services, self.notes)
        """The broker and Postgres, their state and their repair."""
        self._last_recount = 0.0
        self.drain_line: str | None = None
        self._repair = False
        self._stop = threading.Event()
        self._last_rotate = self._last_write = 0.0
        self._written: str = ""
        self.started_at = time.time()

    @property
    def broker(self) -> LocalBroker | None:
        return self.healer.broker

    @property
    def postgres(self) -> LocalPostgres | None:
        return self.healer.postgres

    # ---------------------------------------------------------------- start

    def start_infra(self, previous: dict[str, Any] | None = None) -> Settings:
        """Postgres + migrations + broker + topics (adopting what a dead supervisor left
        running); returns settings pointing at them."""
        from flywheel.db import migrate

        self.logs.mkdir(parents=True, exist_ok=True)
        s, h = self.settings, self.healer
        kafka, db = s.kafka, s.db
        if not db.url:
            h.postgres = LocalPostgres(self.home / "pg", db.local_port,
                                       log_path=self.logs / "postgres.log")
            h.postgres.start()
            h.pg_backoff.started(time.monotonic())
            db = db.model_copy(update={"url": h.postgres.url})
        assert db.url
        migrate.upgrade(db.url)
        if not kafka.bootstrap:
            h.broker = LocalBroker(kafka.local_port, self.logs / "broker.log", bundled=True)
            kafka = kafka.model_copy(update={"bootstrap": h.broker.bootstrap})
        rollout = s.rollout
        if self.vllm is not None and self.vllm.proc is None:
            self.vllm.start()
            log.info("vLLM healthy at %s after %.0fs", self.vllm.url, self.vllm.wait_healthy())
        if self.vllm is not None:
            rollout = rollout.model_copy(update={"vllm_urls": [self.vllm.url]})
        api = s.api.model_copy(update={"tokens": load_or_make_tokens(s)})
        self.settings = s.model_copy(update={"kafka": kafka, "db": db, "api": api,
                                             "rollout": rollout, "home": self.home})
        h.settings = self.settings
        if h.broker is not None:
            h.start_broker(previous)
        else:
            h.ensure_topics()
        self.env = {**os.environ, **settings_env(self.settings), **torch_threads(os.environ)}
        h.env = self.env
        for svc in self.services:
            svc.argv = service_argv(self.settings, svc.name)
        return self.settings

    def start_services(self, previous: dict[str, Any] | None = None) -> None:
        """Spawn every service; services a dead supervisor left running are stopped first,
        all at once (two trainers must never run at once)."""
        orphans = [Service(name, [], self.logs / f"{name}.log", adopted_pid=int(pid))
                   for name, pid in ((previous or {}).get("pids") or {}).items() if pid]
        threads = [threading.Thread(target=o.stop, args=(15,)) for o in orphans]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if orphans:
            self.notes.append(f"replaced {len(orphans)} services a dead supervisor had left")
        now = time.monotonic()
        for svc in self.services:
            svc.start(self.env, now)

    def api_url(self) -> str:
        return f"http://{self.settings.api.host}:{self.settings.api.port}"

    def _wait_api(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.api_url() + "/healthz", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"the API did not answer at {self.api_url()}; see {self.logs}/api.log")

    # ---------------------------------------------------------------- run

    def run(self) -> None:
        """Foreground supervisor: start all, write run.json, keep everything running; stop
        (after draining) on SIGTERM/SIGINT."""
        signal.signal(signal.SIGTERM, lambda *_: self._stop.set())
        signal.signal(signal.SIGINT, lambda *_: self._stop.set())
        signal.signal(signal.SIGUSR1, lambda *_: self._ask_repair())
        become_subreaper()
        previous = read_run(self.settings)
        if previous and previous.get("supervisor_pid") == os.getpid():
            previous = None
        other = int((previous or {}).get("supervisor_pid") or 0)
        if pid_alive(other):
            raise RuntimeError(f"a flywheel supervisor already runs this stack (pid {other}, "
                               f"{run_file(self.settings)}): `flywheel up --detach` checks and "
                               "repairs it, `flywheel down` stops it")
        try:
            self.start_infra(previous)
            self._write(force=True)
            self.start_services(previous)
            self._wait_api()
            self.status = "ready"
            self._write(force=True)
            if self.broker is not None:
                log.warning("%s", MEMORY_ONLY_NOTE)
            log.info("flywheel is up (FLYWHEEL_HOME=%s): api %s, dashboard %s/dashboard "
                     "(tokens in %s)", self.home, self.api_url(), self.api_url(),
                     run_file(self.settings))
            watcher = threading.Thread(target=self._watch, name="watch", daemon=True)
            watcher.start()
            while not self._stop.is_set():
                self.tick()
                self._stop.wait(0.5)
        finally:
            self.shutdown()

    def _ask_repair(self) -> None:
        self._repair = True

    def tick(self) -> None:
        """One round of supervision: heal what died, rotate logs, report."""
        now = time.monotonic()
        if self._repair:
            self._repair = False
            self.healer.reset_backoffs()
        reap_orphans({p.proc.pid for p in self.services if p.proc is not None}
                     | ({self.broker.proc.pid} if self.broker and self.broker.proc else set()))
        try:
            recycle = self.healer.heal(now, ready=self.status == "ready")
            if recycle is not None:
                self.recycle_broker(recycle)
        except Exception:  # one failed repair must not end supervision (and stop the stack)
            log.exception("healing failed; trying again on the next tick")
        losses = self.healer.losses
        if now - self._last_recount >= 5 and self.settings.db.url and losses.open():
            self._last_recount = now
            try:
                run_sync(losses.recount(self.settings.db.url))
            except Exception as err:  # Postgres away: counted again on a later tick
                log.debug("could not recount the losses: %r", err)
        if now - self._last_rotate >= 2:
            self._last_rotate = now
            cfg = self.settings.stack
            for path in self.log_files():
                try:
                    rotate_if_needed(path, cfg.log_max_bytes, cfg.log_keep)
                except OSError as err:
                    log.warning("could not rotate %s: %s", path, err)
        self._write()

    def log_files(self) -> list[Path]:
        files = [s.log for s in self.services]
        if self.broker is not None:
            files.append(self.broker.log_file)
        if self.postgres is not None:
            files.append(self.postgres.log_file)
        files.append(self.logs / "supervisor.log")
        return files

    def _watch(self) -> None:
        """Background: every `watch_interval_s` read each group's lag, so that a lost broker's
        content is known (`recovery`) and the status shows it."""
        asyncio.run(self._watch_rounds())

    async def _watch_rounds(self) -> None:
        """The watch's rounds, on one event loop: the keys of the trajectories not stored
        yet are read as they come by one `KeyTail` per broker instance."""
        groups = consumer_groups(self.settings)
        bootstrap = self.settings.kafka.bootstrap
        assert bootstrap
        tail: KeyTail | None = None
        interval = self.settings.stack.watch_interval_s
        try:
            while not await asyncio.to_thread(self._stop.wait, interval):
                broker = self.broker
                if broker is None:
                    return  # an external Kafka is durable: nothing to track
                try:  # one failed round must never end the watch: later losses go unknown
                    instance = broker.pid
                    if tail is None or tail.instance != instance:
                        if tail is not None:
                            await tail.close()
                        tail = KeyTail(bootstrap, self.settings.topics.trajectories, instance)
                    await tail.read()  # what arrived since the last round, before positions
                    started = time.time()
                    positions = await read_positions(bootstrap, groups)
                    if positions is not None and broker.pid == instance:
                        view = await loss_view(bootstrap, self.settings, positions, tail)
                        self.healer.record_positions(positions, started, view)
                except (Exception, asyncio.CancelledError) as err:
                    task = asyncio.current_task()
                    if isinstance(err, asyncio.CancelledError) and task is not None \
                            and task.cancelling():
                        raise
                    log.exception("a read of the broker's positions failed (retried next round)")
        finally:
            if tail is not None:
                await tail.close()

    # ---------------------------------------------------------------- stop

    def shutdown(self) -> None:
        """Drain (as the stop request asks), then stop services, broker, Postgres."""
        self._stop.set()
        request: dict[str, Any] = {}
        try:
            request = json.loads((self.home / STOP_REQUEST).read_text())
        except (OSError, ValueError):
            pass
        report = None
        # Only the bundled broker forgets: an external Kafka keeps what is not consumed yet.
        if self.status == "ready" and request.get("drain", True) and self.broker is not None:
            report = self.drain(request.get("timeout_s"))
        self.status = "stopping"
        self._write(force=True)
        for svc in self.services:
            svc.held = True
        grace = 45 if self.settings.trainer.ranks > 1 else 15  # torchrun: 30 s for ranks
        # Ingest and the miner stay until the last read (`_settle`): SDK clients publish
        # to the broker directly, and what arrives while the rest stops must be stored too.
        last = [s for s in self.services if s.name in ("ingest", "miner")] if report else []
        _stop_all([s for s in self.services if s not in last], grace)
        lost = None
        if report is not None:
            self._settle(report)
            if not report.done and self.settings.db.url:
                lost = run_sync(count_loss(self.settings.db.url, self.healer.broker_state()))
        _stop_all(last, grace)
        if self.vllm is not None:
            self.vllm.stop()
        if self.broker is not None:
            self.broker.stop()
        if self.postgres is not None:
            self.postgres.stop()
        if report is not None and report.done:
            self.healer.mark_drained()
        summary = report.summary() if report else (
            "stopped without draining" if self.broker is not None else
            "stopped (no drain needed: the external Kafka keeps what is not consumed yet)")
        if lost is not None and lost["not_stored"]:
            summary += (f"; {lost['not_stored']} acknowledged records not stored when the "
                        "broker stopped: lost unless their producers send them again (the "
                        "SDK does); the next `flywheel up` and `flywheel status` count them")
        write_json_private(self.home / LAST_STOP, {
            "stopped_at": time.time(), "summary": summary, "lost": lost,
            "drain": None if report is None else vars(report)})
        (self.home / STOP_REQUEST).unlink(missing_ok=True)
        run_file(self.settings).unlink(missing_ok=True)
        log.info("stopped: %s", summary)

    def _settle(self, report: Any) -> None:
        """The last reads before the broker stops, ingest and the miner still running:
        drained only once nothing is left to store and nothing arrived for a second; else
        (producers still publishing past `stack.drain_settle_s`) not drained, and what the
        last read saw unstored is counted as lost."""
        assert self.settings.kafka.bootstrap
        bootstrap, groups = self.settings.kafka.bootstrap, consumer_groups(self.settings)
        deadline = time.monotonic() + self.settings.stack.drain_settle_s
        previous: dict[str, Any] | None = None
        while True:
            started = time.time()
            positions = run_sync(read_positions(bootstrap, groups))
            if positions is None:
                report.done = False
                report.notes.append("the broker did not answer the last read before it "
                                    "stopped")
                return
            view = run_sync(loss_view(bootstrap, self.settings, positions))
            self.healer.record_positions(positions, started, view)
            report.lag = {g: sum(max(0, h - c) for c, h in parts.values())
                          for g, parts in positions.items()}
            report.trajectories_drained = all(report.lag[g] == 0
                                              for g in report.trajectory_groups)
            left = unstored_total(view)
            came = None if previous is None else arrived(previous, view)
            if left == 0 and came == 0:
                return
            if time.monotonic() >= deadline:
                report.done = report.trajectories_drained = False
                report.notes.append(
                    f"still arriving when the broker stopped ({came or 0} records in the last"
                    f" second; {left} not stored at the last read): producers kept publishing;"
                    " what the broker acknowledged after that read is not counted (SDK clients"
                    " hold it until stored and send it again to the next broker)")
                return
            previous = view
            time.sleep(1.0)

    def drain(self, timeout_s: float | None = None) -> Any:
        """Close intake, stop the scheduler, wait for the consumers (see `drain`)."""
        self.status = "draining"
        self._write(force=True)
        token = operate_token(self.settings)
        why = close_intake(self.api_url(), token)
        scheduler = next(s for s in self.services if s.name == "scheduler")
        scheduler.held = True
        scheduler.stop(15)

        def progress(line: str) -> None:
            self.drain_line = line
            log.info("%s", line)
            self._write(force=True)

        report = run_sync(drain(self.settings, tick=self.tick, progress=progress,
                                timeout_s=timeout_s))
        report.intake_closed = why is None
        if why:
            report.notes.append(why)
        if report.positions and report.read_at:
            self.healer.record_positions(report.positions, report.read_at)
        self.drain_line = report.summary()
        log.info("%s", self.drain_line)
        return report

    def recycle_broker(self, reason: str) -> None:
        """Drain, then replace the broker with a fresh one (the only way to free a
        memory-only broker's memory before `retention.ms`); intake and the scheduler resume
        afterwards."""
        log.warning("recycling the bundled broker: %s", reason)
        self.notes.append(f"broker recycled: {reason}")
        drained = self.drain()
        self.healer.replace_broker(time.monotonic(), drained=drained.done)
        scheduler = next(s for s in self.services if s.name == "scheduler")
        scheduler.start(self.env, time.monotonic())
        reopen_intake(self.api_url(), operate_token(self.settings))
        self.status, self.drain_line = "ready", None

    # ---------------------------------------------------------------- report

    def _write(self, *, force: bool = False) -> None:
        """run.json, when something changed (at most once a second unless forced)."""
        now = time.monotonic()
        if not force and now - self._last_write < 1.0:
            return
        data = self.report()
        digest = json.dumps(data, sort_keys=True, default=str)
        if digest == self._written and not force:
            return
        write_json_private(run_file(self.settings), {**data, "updated_at": time.time()})
        self._written, self._last_write = digest, now

    def report(self) -> dict[str, Any]:
        """run.json: where everything is and how every component is doing."""
        s, broker, vllm = self.settings, self.broker, self.vllm
        return {
            "status": self.status, "supervisor_pid": os.getpid(), "started_at": self.started_at,
            "kafka_bootstrap": s.kafka.bootstrap, "database_url": s.db.url,
            "api_url": self.api_url(), "dashboard_url": self.api_url() + "/dashboard",
            "topics": s.topics.model_dump(), "tokens": s.api.tokens,
            "pids": {x.name: x.pid for x in self.services if x.pid},
            "broker_pid": broker.pid if broker else None,
            "vllm_url": vllm.url if vllm else None,
            "vllm_pid": vllm.proc.pid if vllm and vllm.proc else None,
            "postgres_data": str(self.postgres.data_dir) if self.postgres else None,
            "logs": str(self.logs), "home": str(self.home),
            "components": self.healer.components(),
            "broker": self.healer.broker_report(),
            "notes": [mask_text(n) for n in self.notes[-10:]],
            "drain": self.drain_line,
        }


def _stop_all(services: list[Service], grace: float) -> None:
    threads = [threading.Thread(target=s.stop, args=(grace,)) for s in services]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
