"""What the supervisor (`Stack.tick`) repairs: the local Postgres, the bundled broker, services.

`Healer` owns the infrastructure's state: the broker and Postgres handles, their backoffs
and last errors, what the running broker instance holds (`broker_state`, saved for
`recovery`), the recovery still owed after a replacement, and the open losses. Each dead
component is restarted once its backoff allows. A dead broker is handled as a replacement:
the Kafka consumers are stopped first (a consumer that kept its position on the old broker
would start the new one past records it never read), the broker is started afresh, topics
are recreated and the outbox events the old instance may have held are republished
(`recovery`), then the consumers start again.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from flywheel.config import Settings
from flywheel.runtime.kafka import consumer_groups
from flywheel.runtime.logs import mask_text
from flywheel.runtime.losses import Losses, count_loss, with_earlier_keys
from flywheel.stack import recovery
from flywheel.stack.broker import MEMORY_ONLY_NOTE, LocalBroker
from flywheel.stack.drain import Positions
from flywheel.stack.launch import KAFKA_CONSUMERS
from flywheel.stack.postgres import LocalPostgres
from flywheel.stack.processes import Backoff, Service, rss_mb, run_sync

log = logging.getLogger("flywheel.up")

RECYCLE_EVERY_S = 600.0
"""Recycle the broker for memory at most this often: a cap set below what the broker
needs idle must not turn into a restart loop (it is said in the status instead)."""


class Healer:
    """The broker's and Postgres's state under supervision, and one round of repair.

    `services` and `notes` are the supervisor's (shared lists); `settings` and `env` are
    set by the supervisor once its infrastructure is known (`Stack.start_infra`)."""

    def __init__(self, settings: Settings, services: list[Service], notes: list[str]) -> None:
        self.settings = settings
        self.home = settings.home.resolve()
        self.services = services
        self.notes = notes
        self.env: dict[str, str] = {}
        cap = settings.stack.restart_backoff_max_s
        self.broker: LocalBroker | None = None
        self.postgres: LocalPostgres | None = None
        self.broker_backoff, self.pg_backoff = Backoff(cap), Backoff(cap)
        self.broker_error: str | None = None
        self.pg_error: str | None = None
        self.pending_recovery: dict[str, Any] | None = None
        """What a replaced broker's predecessor held, while republishing it has not
        succeeded yet (the new broker runs; `heal` retries the recovery, not the broker)."""
        self.recovery_retry_at, self.recovery_attempts = 0.0, 0
        self.last_recycle: float | None = None
        self.losses = Losses(self.home)
        """What lost broker instances took with them, kept until an operator acknowledges
        it (`flywheel losses ack`); recounted while producers re-send."""
        self._broker_state: dict[str, Any] = recovery.new_state(None, None)
        self._lock = threading.Lock()  # `_watch` records positions from its own thread

    # ---------------------------------------------------------------- broker state

    def broker_state(self) -> dict[str, Any]:
        """A copy of what the running broker instance holds (as of its last read)."""
        with self._lock:
            return dict(self._broker_state)

    def _save_state(self, state: dict[str, Any]) -> None:
        with self._lock:
            self._broker_state = state
            recovery.save_state(self.home, state)

    def record_positions(self, positions: Positions, read_at: float,
                         view: dict[str, Any] | None = None) -> None:
        """Fold one read into the broker instance's state; `view` (`losses.loss_view`) is
        what its loss would be counted from, were it lost now."""
        with self._lock:
            state = self._broker_state
            if self.broker is None or state.get("broker_pid") != self.broker.pid:
                return  # read from an instance that is gone
            recovery.record(state, positions, read_at)
            state.update(with_earlier_keys(state, view) if view else {})
            recovery.save_state(self.home, state)

    def mark_drained(self) -> None:
        """The broker stopped drained: a later start republishes without counting a loss."""
        with self._lock:
            self._broker_state["drained"] = True
            recovery.save_state(self.home, self._broker_state)

    def reset_backoffs(self) -> None:
        for b in (self.broker_backoff, self.pg_backoff, *(s.backoff for s in self.services)):
            b.reset()

    # ---------------------------------------------------------------- start

    def ensure_topics(self) -> None:
        from flywheel.runtime.kafka import ensure_topics as create

        k = self.settings.kafka
        assert k.bootstrap
        run_sync(create(k.bootstrap, self.settings.topics.all(), partitions=k.partitions,
                        retention_ms=k.retention_ms, replication_factor=k.replication_factor))

    def start_broker(self, previous: dict[str, Any] | None) -> None:
        """Adopt the broker a dead supervisor left running, else start one; in that case
        republish what the previous instance may have taken with it."""
        assert self.broker is not None
        saved = recovery.load_state(self.home)
        pid = (previous or {}).get("broker_pid")
        matches = saved is not None and saved.get("broker_pid") == pid
        started_at = (saved or {}).get("started_at") if matches else \
            ((previous or {}).get("broker") or {}).get("started_at")
        if pid and self.broker.adopt(int(pid), started_at):
            if matches:
                assert saved is not None
                self._save_state(saved)
            else:  # its consumption state was never saved (e.g. the supervisor died first)
                self._save_state(recovery.new_state(int(pid), started_at))
            self.notes.append(f"kept the running broker (pid {pid}) and what it holds")
        else:
            self.broker.start()
            self.recover_lost(saved)
        self.broker_backoff.started(time.monotonic())

    def recover_lost(self, lost: dict[str, Any] | None) -> None:
        """After starting a fresh broker: topics, then republish what the lost instance may
        have held (`recovery`), and say what could not be."""
        s = self.settings
        assert self.broker is not None and s.db.url and s.kafka.bootstrap
        self.ensure_topics()
        if lost and lost.get("started_at"):
            groups = consumer_groups(s)
            topic = s.topics.trajectories
            since = recovery.republish_since(lost.get("clean_at") or {}, lost["started_at"],
                                             groups)
            # Stored trajectories: those of the lost instance from the first offset a group
            # had not committed (time alone would resend everything a slow miner never
            # caught up on).
            since[topic] = lost["started_at"] - recovery.MARGIN_S
            starts = recovery.first_unconsumed(lost, [g for g, t in groups if t == topic])
            counts = run_sync(recovery.republish(s.db.url, s.kafka.bootstrap, since, topic,
                                                 starts))
            events, stored = sum(n for t, n in counts.items() if t != topic), counts.get(topic, 0)
            if lost.get("drained"):
                self.notes.append(f"the previous broker was drained before it stopped; {events}"
                                  f" recent events and {stored} stored trajectories republished "
                                  "(already consumed: no-ops)")
            else:
                # Exact as of the instance's last read: what it had acknowledged and Postgres
                # does not hold (`losses`); recounted while SDK clients send theirs again.
                loss = {**run_sync(count_loss(s.db.url, lost)),
                        **{k: v for k, v in recovery.loss_report(lost, groups, topic).items()
                           if k in ("lag", "lag_read_age_s")}, "republished": counts}
                self.losses.add(loss)
                age = loss["lag_read_age_s"]
                per_topic = ", ".join(f"{t} {d['not_stored']}" for t, d in loss["topics"].items())
                head = (f"a broker instance was lost: {events} outbox events and {stored} "
                        "stored trajectories republished to the new one; ")
                self.notes.append(
                    head + f"{loss['not_stored']} records it had acknowledged are not stored "
                    f"({per_topic}; as of its last read, {age:.0f}s before; records SDK clients"
                    f" send again are taken off; loss {loss['id']}, `flywheel losses ack` once "
                    "handled)" if loss["not_stored"] is not None else
                    head + "what it had acknowledged and Flywheel had not stored is not known: "
                    "no read of it came before it was lost (SDK clients send theirs again; "
                    f"loss {loss['id']}, `flywheel losses ack` once handled)")
            log.warning("%s", self.notes[-1])
        self._save_state(recovery.new_state(self.broker.pid, self.broker.started_at))

    # ---------------------------------------------------------------- heal

    def heal(self, now: float, *, ready: bool) -> str | None:
        """One round: restart what died once its backoff allows. Returns why the broker
        should be recycled (over its memory cap while the stack is `ready`), else None."""
        self._postgres(now)
        self._broker(now)
        for svc in self.services:
            if svc.held or svc.alive():
                continue
            svc.backoff.died(now)
            if svc.backoff.due(now):
                log.warning("%s exited with %s; restarting (restart %d)", svc.name,
                            svc.last_exit, svc.backoff.restarts + 1)
                svc.start(self.env, now)
                svc.backoff.restarts += 1
        return self._memory(now) if ready else None

    def _memory(self, now: float) -> str | None:
        broker, cap = self.broker, self.settings.stack.broker_max_rss_mb
        if broker is None or not broker.alive():
            return None
        rss = rss_mb(broker.pid)
        if rss is None or rss <= cap:
            return None
        if self.last_recycle is not None and now - self.last_recycle < RECYCLE_EVERY_S:
            note = (f"the broker holds {rss:.0f} MiB, over stack.broker_max_rss_mb ({cap} MiB),"
                    f" within {RECYCLE_EVERY_S:.0f}s of its last recycle: raise the cap")
            if not self.notes or self.notes[-1] != note:
                self.notes.append(note)
                log.warning("%s", note)
            return None
        self.last_recycle = now
        return f"it held {rss:.1f} MiB, over stack.broker_max_rss_mb ({cap} MiB)"

    def _postgres(self, now: float) -> None:
        pg = self.postgres
        if pg is None or pg.alive():
            return
        b = self.pg_backoff
        if b.died_at is None:
            log.error("Postgres (pid %s) died; restarting it (services retry meanwhile)",
                      pg.pid())
        b.died(now)
        if not b.due(now):
            return
        b.restarting(now)
        try:
            pg.start()
        except (RuntimeError, OSError) as err:
            self.pg_error = postgres_reason(str(err))
            log.error("Postgres did not start (retrying in %.0fs): %s", b.delay(), self.pg_error)
            b.died_at = None
            b.died(time.monotonic())
            return
        self.pg_error = None
        log.warning("Postgres restarted (restart %d)", b.restarts)

    def _broker(self, now: float) -> None:
        broker = self.broker
        if broker is None:
            return
        if broker.alive():
            if self.pending_recovery is not None and now >= self.recovery_retry_at:
                self._finish_recovery(self.pending_recovery, now)
            return
        b = self.broker_backoff
        if b.died_at is None:
            log.error("the bundled broker (pid %s) died: what it held in memory is gone; "
                      "stopping the Kafka consumers and restarting it", broker.pid)
            self.hold_consumers()
        b.died(now)
        if b.due(now):
            self.replace_broker(now, drained=False)

    def hold_consumers(self) -> None:
        """Stop every Kafka consumer, at once: they are stateless (Postgres and the outbox
        hold their work) and cannot commit anything to a dead broker anyway."""
        held = [s for s in self.services if s.name in KAFKA_CONSUMERS and not s.held]
        for svc in held:
            svc.held = True
        threads = [threading.Thread(target=svc.stop, args=(3,)) for svc in held]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def replace_broker(self, now: float, *, drained: bool) -> None:
        """Stop the Kafka consumers and the broker (if it still runs), start a fresh broker,
        recover topics and outbox events, start the consumers again."""
        broker = self.broker
        assert broker is not None
        self.hold_consumers()
        lost = {**self.broker_state(), "drained": drained}
        broker.stop()
        b = self.broker_backoff
        b.restarting(now)
        try:
            broker.start()
        except (RuntimeError, OSError) as err:
            self.broker_error = mask_text(str(err))[-600:]
            log.error("the broker did not start (retrying in %.0fs): %s", b.delay(),
                      self.broker_error)
            self._save_state({**lost})  # still what was lost
            b.died_at = None
            b.died(time.monotonic())
            return
        self._finish_recovery(lost, time.monotonic())

    def _finish_recovery(self, lost: dict[str, Any], now: float) -> None:
        """Topics, republishing and the consumers on a broker that runs. A failure (a fresh
        broker answering UNKNOWN_SERVER_ERROR for a moment, Postgres away) is retried on a
        later tick against the same broker: it holds nothing yet, so replacing it again would
        gain nothing, and the consumers stay held until it is done."""
        try:
            self.recover_lost(lost)
        except Exception as err:  # every failure here is retried; none may end supervision
            self.recovery_attempts += 1
            delay = min(30.0, 0.5 * 2 ** self.recovery_attempts)
            self.broker_error = mask_text(f"recovery after the broker restart: {err!r}")[-600:]
            log.warning("%s (retrying in %.0fs)", self.broker_error, delay)
            self._save_state({**lost})  # still what was lost
            self.pending_recovery, self.recovery_retry_at = lost, now + delay
            return
        self.pending_recovery, self.broker_error, self.recovery_attempts = None, None, 0
        started = time.monotonic()
        for svc in self.services:
            if svc.name in KAFKA_CONSUMERS:
                svc.start(self.env, started)
        log.warning("broker restarted (restart %d); topics recreated, consumers restarted",
                    self.broker_backoff.restarts)

    # ---------------------------------------------------------------- report

    def components(self) -> dict[str, dict[str, Any]]:
        """Per component: state (up, down, restarting, stopped), pid, restarts, last error."""
        out: dict[str, dict[str, Any]] = {}
        if self.postgres is not None:
            pg = self.postgres
            out["postgres"] = {"state": "up" if pg.alive() else "down", "pid": pg.pid(),
                               "restarts": self.pg_backoff.restarts,
                               "last_error": self.pg_error, "log": str(pg.log_file)}
        if self.broker is not None:
            br = self.broker
            alive = br.alive()
            out["broker"] = {"state": "up" if alive else "down", "pid": br.pid,
                             "restarts": self.broker_backoff.restarts,
                             "last_error": self.broker_error, "log": str(br.log_file),
                             "rss_mb": round(rss_mb(br.pid) or 0, 1) if alive else None}
        for svc in self.services:
            out[svc.name] = svc.report()
        return out

    def broker_report(self) -> dict[str, Any] | None:
        """run.json's `broker`: memory-only, when it started, the losses not acknowledged."""
        if self.broker is None:
            return None
        return {"memory_only": True, "note": MEMORY_ONLY_NOTE,
                "started_at": self.broker.started_at, "losses": self.losses.open()}


def postgres_reason(failure: str) -> str:
    """The lines of a failed start that say why (FATAL, PANIC, HINT), secrets masked."""
    lines = failure.splitlines()
    head = lines[0] if lines else "postgres did not start"
    why = [" ".join(ln.split("] ", 1)[-1].split()) for ln in lines[1:]
           if any(k in ln for k in ("FATAL:", "PANIC:", "ERROR:", "could not"))]
    return mask_text(head.rstrip(":") + ": " + "; ".join(dict.fromkeys(why[-4:])))[:600]
