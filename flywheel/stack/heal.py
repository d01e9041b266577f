"""One round of healing for the supervisor (`Stack.tick`): Postgres, the broker, services.

Each dead component is restarted once its backoff allows. A dead broker is handled as a
replacement: the Kafka consumers are stopped first (a consumer that kept its position on
the old broker would start the new one past records it never read), the broker is started
afresh, topics are recreated and the outbox events the old instance may have held are
republished (`recovery`), then the consumers start again.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from flywheel.runtime.kafka import consumer_groups
from flywheel.runtime.logs import mask_text
from flywheel.runtime.losses import count_loss
from flywheel.stack import recovery
from flywheel.stack.launch import KAFKA_CONSUMERS
from flywheel.stack.processes import rss_mb, run_sync

if TYPE_CHECKING:
    from flywheel.stack.supervisor import Stack

log = logging.getLogger("flywheel.up")


def ensure_topics(stack: Stack) -> None:
    from flywheel.runtime.kafka import ensure_topics as create

    k = stack.settings.kafka
    assert k.bootstrap
    run_sync(create(k.bootstrap, stack.settings.topics.all(), partitions=k.partitions,
                       retention_ms=k.retention_ms, replication_factor=k.replication_factor))


def start_broker(stack: Stack, previous: dict[str, Any] | None) -> None:
    """Adopt the broker a dead supervisor left running, else start one; in that case
    republish what the previous instance may have taken with it."""
    assert stack.broker is not None
    saved = recovery.load_state(stack.home)
    pid = (previous or {}).get("broker_pid")
    matches = saved is not None and saved.get("broker_pid") == pid
    started_at = (saved or {}).get("started_at") if matches else \
        ((previous or {}).get("broker") or {}).get("started_at")
    if pid and stack.broker.adopt(int(pid), started_at):
        if matches:
            assert saved is not None
            stack.broker_state = saved
        else:  # its consumption state was never saved (e.g. the supervisor died first)
            stack.broker_state = recovery.new_state(int(pid), started_at)
            recovery.save_state(stack.home, stack.broker_state)
        stack.notes.append(f"kept the running broker (pid {pid}) and what it holds")
    else:
        stack.broker.start()
        recover_lost(stack, saved)
    stack.broker_backoff.started(time.monotonic())


def recover_lost(stack: Stack, lost: dict[str, Any] | None) -> None:
    """After starting a fresh broker: topics, then republish what the lost instance may
    have held (`recovery`), and say what could not be."""
    assert stack.broker is not None and stack.settings.db.url and stack.settings.kafka.bootstrap
    ensure_topics(stack)
    if lost and lost.get("started_at"):
        groups = consumer_groups(stack.settings)
        topic = stack.settings.topics.trajectories
        since = recovery.republish_since(lost.get("clean_at") or {}, lost["started_at"], groups)
        # Stored trajectories: those of the lost instance from the first offset a group had
        # not committed (time alone would resend everything a slow miner never caught up on).
        since[topic] = lost["started_at"] - recovery.MARGIN_S
        starts = recovery.first_unconsumed(lost, [g for g, t in groups if t == topic])
        counts = run_sync(recovery.republish(stack.settings.db.url,
                                             stack.settings.kafka.bootstrap, since, topic,
                                             starts))
        events, stored = sum(n for t, n in counts.items() if t != topic), counts.get(topic, 0)
        if lost.get("drained"):
            stack.notes.append(f"the previous broker was drained before it stopped; {events} "
                               f"recent events and {stored} stored trajectories republished "
                               "(already consumed: no-ops)")
        else:
            # Exact as of the instance's last read: what it had acknowledged and Postgres
            # does not hold (`losses`); recounted while SDK clients send theirs again.
            loss = {**run_sync(count_loss(stack.settings.db.url, lost)),
                    **{k: v for k, v in recovery.loss_report(lost, groups, topic).items()
                       if k in ("lag", "lag_read_age_s")}, "republished": counts}
            stack.losses.add(loss)
            age = loss["lag_read_age_s"]
            per_topic = ", ".join(f"{t} {d['not_stored']}" for t, d in loss["topics"].items())
            stack.notes.append(
                f"a broker instance was lost: {events} outbox events and {stored} stored "
                f"trajectories republished to the new one; {loss['not_stored']} records it "
                "had acknowledged are not stored"
                + (f" ({per_topic}; as of its last read, {age:.0f}s before; records SDK "
                   f"clients send again are taken off; loss {loss['id']}, `flywheel losses "
                   "ack` once handled)" if age is not None else
                   " (no read of it came before: what it took is not known)"))
        log.warning("%s", stack.notes[-1])
    with stack._lock:
        stack.broker_state = recovery.new_state(stack.broker.pid, stack.broker.started_at)
        recovery.save_state(stack.home, stack.broker_state)


def heal(stack: Stack, now: float) -> None:
    _postgres(stack, now)
    _broker(stack, now)
    for svc in stack.services:
        if svc.held or svc.alive():
            continue
        svc.backoff.died(now)
        if svc.backoff.due(now):
            log.warning("%s exited with %s; restarting (restart %d)", svc.name, svc.last_exit,
                        svc.backoff.restarts + 1)
            svc.start(stack.env, now)
            svc.backoff.restarts += 1
    _memory(stack, now)


RECYCLE_EVERY_S = 600.0
"""Recycle the broker for memory at most this often: a cap set below what the broker
needs idle must not turn into a restart loop (it is said in the status instead)."""


def _memory(stack: Stack, now: float) -> None:
    broker, cap = stack.broker, stack.settings.stack.broker_max_rss_mb
    if broker is None or stack.status != "ready" or not broker.alive():
        return
    rss = rss_mb(broker.pid)
    if rss is None or rss <= cap:
        return
    if stack.last_recycle is not None and now - stack.last_recycle < RECYCLE_EVERY_S:
        note = (f"the broker holds {rss:.0f} MiB, over stack.broker_max_rss_mb ({cap} MiB), "
                f"within {RECYCLE_EVERY_S:.0f}s of its last recycle: raise the cap")
        if not stack.notes or stack.notes[-1] != note:
            stack.notes.append(note)
            log.warning("%s", note)
        return
    stack.last_recycle = now
    recycle_broker(stack, f"it held {rss:.1f} MiB, over stack.broker_max_rss_mb ({cap} MiB)")


def _postgres(stack: Stack, now: float) -> None:
    pg = stack.postgres
    if pg is None or pg.alive():
        return
    b = stack.pg_backoff
    if b.died_at is None:
        log.error("Postgres (pid %s) died; restarting it (services retry meanwhile)", pg.pid())
    b.died(now)
    if not b.due(now):
        return
    b.restarting(now)
    try:
        pg.start()
    except (RuntimeError, OSError) as err:
        stack.pg_error = postgres_reason(str(err))
        log.error("Postgres did not start (retrying in %.0fs): %s", b.delay(), stack.pg_error)
        b.died_at = None
        b.died(time.monotonic())
        return
    stack.pg_error = None
    log.warning("Postgres restarted (restart %d)", b.restarts)


def postgres_reason(failure: str) -> str:
    """The lines of a failed start that say why (FATAL, PANIC, HINT), secrets masked."""
    lines = failure.splitlines()
    head = lines[0] if lines else "postgres did not start"
    why = [" ".join(ln.split("] ", 1)[-1].split()) for ln in lines[1:]
           if any(k in ln for k in ("FATAL:", "PANIC:", "ERROR:", "could not"))]
    return mask_text(head.rstrip(":") + ": " + "; ".join(dict.fromkeys(why[-4:])))[:600]


def _broker(stack: Stack, now: float) -> None:
    broker = stack.broker
    if broker is None:
        return
    if broker.alive():
        if stack.pending_recovery is not None and now >= stack.recovery_retry_at:
            _finish_recovery(stack, stack.pending_recovery, now)
        return
    b = stack.broker_backoff
    if b.died_at is None:
        log.error("the bundled broker (pid %s) died: what it held in memory is gone; "
                  "stopping the Kafka consumers and restarting it", broker.pid)
        _hold_consumers(stack)
    b.died(now)
    if b.due(now):
        replace_broker(stack, now, drained=False)


def _hold_consumers(stack: Stack) -> None:
    """Stop every Kafka consumer, at once: they are stateless (Postgres and the outbox
    hold their work) and cannot commit anything to a dead broker anyway."""
    held = [s for s in stack.services if s.name in KAFKA_CONSUMERS and not s.held]
    for svc in held:
        svc.held = True
    threads = [threading.Thread(target=svc.stop, args=(3,)) for svc in held]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def replace_broker(stack: Stack, now: float, *, drained: bool) -> None:
    """Stop the Kafka consumers and the broker (if it still runs), start a fresh broker,
    recover topics and outbox events, start the consumers again."""
    broker = stack.broker
    assert broker is not None
    _hold_consumers(stack)
    with stack._lock:
        lost = {**stack.broker_state, "drained": drained}
    broker.stop()
    b = stack.broker_backoff
    b.restarting(now)
    try:
        broker.start()
    except (RuntimeError, OSError) as err:
        stack.broker_error = mask_text(str(err))[-600:]
        log.error("the broker did not start (retrying in %.0fs): %s", b.delay(),
                  stack.broker_error)
        with stack._lock:
            stack.broker_state = {**lost}  # still what was lost
            recovery.save_state(stack.home, stack.broker_state)
        b.died_at = None
        b.died(time.monotonic())
        return
    _finish_recovery(stack, lost, time.monotonic())


def _finish_recovery(stack: Stack, lost: dict[str, Any], now: float) -> None:
    """Topics, republishing and the consumers on a broker that runs. A failure (a fresh
    broker answering UNKNOWN_SERVER_ERROR for a moment, Postgres away) is retried on a
    later tick against the same broker: it holds nothing yet, so replacing it again would
    gain nothing, and the consumers stay held until it is done."""
    try:
        recover_lost(stack, lost)
    except Exception as err:  # every failure here is retried; none may end supervision
        stack.recovery_attempts += 1
        delay = min(30.0, 0.5 * 2 ** stack.recovery_attempts)
        stack.broker_error = mask_text(f"recovery after the broker restart: {err!r}")[-600:]
        log.warning("%s (retrying in %.0fs)", stack.broker_error, delay)
        with stack._lock:
            stack.broker_state = {**lost}  # still what was lost
            recovery.save_state(stack.home, stack.broker_state)
        stack.pending_recovery, stack.recovery_retry_at = lost, now + delay
        return
    stack.pending_recovery, stack.broker_error, stack.recovery_attempts = None, None, 0
    started = time.monotonic()
    for svc in stack.services:
        if svc.name in KAFKA_CONSUMERS:
            svc.start(stack.env, started)
    log.warning("broker restarted (restart %d); topics recreated, consumers restarted",
                stack.broker_backoff.restarts)


def components(stack: Stack) -> dict[str, dict[str, Any]]:
    """Per component: state (up, down, restarting, stopped), pid, restarts, last error."""
    out: dict[str, dict[str, Any]] = {}
    if stack.postgres is not None:
        pg = stack.postgres
        out["postgres"] = {"state": "up" if pg.alive() else "down", "pid": pg.pid(),
                           "restarts": stack.pg_backoff.restarts, "last_error": stack.pg_error,
                           "log": str(pg.log_file)}
    if stack.broker is not None:
        br = stack.broker
        alive = br.alive()
        out["broker"] = {"state": "up" if alive else "down", "pid": br.pid,
                         "restarts": stack.broker_backoff.restarts,
                         "last_error": stack.broker_error, "log": str(br.log_file),
                         "rss_mb": round(rss_mb(br.pid) or 0, 1) if alive else None}
    for svc in stack.services:
        out[svc.name] = svc.report()
    return out


def report(stack: Stack) -> dict[str, Any]:
    """run.json: where everything is and how every component is doing."""
    from flywheel.stack.broker import MEMORY_ONLY_NOTE

    s = stack.settings
    return {
        "status": stack.status, "supervisor_pid": os.getpid(), "started_at": stack.started_at,
        "kafka_bootstrap": s.kafka.bootstrap, "database_url": s.db.url,
        "api_url": stack.api_url(), "dashboard_url": stack.api_url() + "/dashboard",
        "topics": s.topics.model_dump(), "tokens": s.api.tokens,
        "pids": {x.name: x.pid for x in stack.services if x.pid},
        "broker_pid": stack.broker.pid if stack.broker else None,
        "vllm_url": stack.vllm.url if stack.vllm else None,
        "vllm_pid": stack.vllm.proc.pid if stack.vllm and stack.vllm.proc else None,
        "postgres_data": str(stack.postgres.data_dir) if stack.postgres else None,
        "logs": str(stack.logs), "home": str(stack.home),
        "components": components(stack),
        "broker": None if stack.broker is None else {
            "memory_only": True, "note": MEMORY_ONLY_NOTE,
            "started_at": stack.broker.started_at, "losses": stack.losses.open()},
        "notes": [mask_text(n) for n in stack.notes[-10:]],
        "drain": stack.drain_line,
    }


def recycle_broker(stack: Stack, reason: str) -> None:
    """Drain, then replace the broker with a fresh one (the only way to free a memory-only
    broker's memory before `retention.ms`); intake and the scheduler resume afterwards."""
    from flywheel.stack.drain import reopen_intake
    from flywheel.stack.launch import operate_token

    log.warning("recycling the bundled broker: %s", reason)
    stack.notes.append(f"broker recycled: {reason}")
    drained = stack.drain()
    replace_broker(stack, time.monotonic(), drained=drained.done)
    scheduler = next(s for s in stack.services if s.name == "scheduler")
    scheduler.start(stack.env, time.monotonic())
    reopen_intake(stack.api_url(), operate_token(stack.settings))
    stack.status, stack.drain_line = "ready", None
