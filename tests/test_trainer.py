"""The trainer on the real model: on-policy ratios, kill-and-resume, corrupted artifacts."""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import asyncpg
import pytest
from aiokafka import AIOKafkaProducer

from flywheel.adapters.local import AdapterStore, CorruptAdapter
from flywheel.config import Settings, settings_env
from flywheel.db.engine import make_engine
from flywheel.demo.samples import TOOLS
from flywheel.environments import load_environment
from flywheel.events import GroupScored, GroupScoredPayload
from flywheel.mining.demos import Demonstration, assistant_reply
from flywheel.mining.store import store_task
from flywheel.policy.local import LocalPolicy
from flywheel.policy.model_cache import resolve_model_dir
from flywheel.rollout.loop import GroupConfig, run_group
from flywheel.runtime.kafka import ensure_topics
from flywheel.tasks import ExpectedCall, TaskSpec, ToolCallSpec
from tests.support.helpers import scalar, spawn

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.postgres]
GROUPS = 6
DIST_S = 15
"""The torchrun job's process-group timeout: idle past it, followers live on pings alone (a
step's collective waits for the slower rank, well inside it on a loaded 2-core machine)."""


def _shots() -> list[dict[str, object]]:
    """Three earlier requests answered with a call (what a mined task's context often holds):
    with them the untuned model writes `<tool_call>` blocks, right or wrong, so its groups
    have reward variance (without, it answers in prose: every reward 0)."""
    out: list[dict[str, object]] = []
    for n, (city, temp) in enumerate([("Rome", 18), ("Cairo", 31), ("Berlin", 9)]):
        out += [{"role": "user", "content": f"What's the weather in {city}?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": f"c{n}", "type": "function", "function": {
                        "name": "get_weather",
                        "arguments": json.dumps({"city": city, "unit": "c"})}}]},
                {"role": "tool", "tool_call_id": f"c{n}", "content": json.dumps({"temp_c": temp})},
                {"role": "assistant", "content": f"It is {temp} °C in {city}."}]
    return out


def _task(city: str) -> TaskSpec:
    return TaskSpec(task_id=uuid.uuid4(), env="tool_call", tools=TOOLS,
                    messages=[*_shots(),
                              {"role": "user", "content": f"What's the weather in {city}?"}],
                    verifier=ToolCallSpec(expected=ExpectedCall(
                        name="get_weather", arguments={"city": city, "unit": "c"})),
                    failure_mode="bad_arguments", fingerprint=f"fp-{city}-{uuid.uuid4()}",
                    split="train")


@pytest.fixture(scope="module")
def groups() -> list[tuple[TaskSpec, GroupScoredPayload]]:
    """Real groups sampled from the base model (trainable ones only)."""
    async def sample() -> list[tuple[TaskSpec, GroupScoredPayload]]:
        policy = LocalPolicy(resolve_model_dir(None))
        out: list[tuple[TaskSpec, GroupScoredPayload]] = []
        cfg = GroupConfig(group_size=4, max_tokens=48, temperature=1.0)  # a call: ~40
        cities = ["Oslo", "Lima", "Pune", "Quito", "Paris", "Lagos", "Osaka", "Austin"] * 3
        env = load_environment("tool_call")
        # Eight groups at a time share the engine's forwards (32 rows); each group's seed
        # makes it draw what it would alone, so the first GROUPS trainable ones are the same.
        for start in range(0, len(cities), 8):
            tasks = [_task(city) for city in cities[start:start + 8]]
            sampled = await asyncio.gather(*(
                run_group(policy, task, env, cfg, adapter=None, seed=start + i,
                          group_key=cities[start + i]) for i, task in enumerate(tasks)))
            out += [(task, GroupScoredPayload(
                group_id=uuid.uuid4(), task_id=task.task_id, env="tool_call",
                adapter=None, adapter_version=None, temperature=1.0,
                rollouts=g.rollouts, reward_mean=g.reward_mean, reward_std=g.reward_std,
                trainable=True, worker="test"))
                for task, g in zip(tasks, sampled, strict=True) if g.trainable]
            if len(out) >= GROUPS:
                break
        await policy.close()
        return out[:GROUPS]

    found = asyncio.run(sample())
    assert len(found) == GROUPS, "the base model should give varied rewards"
    return found


def test_fresh_adapter_is_on_policy_and_a_step_is_finite(
        groups: list[tuple[TaskSpec, GroupScoredPayload]]) -> None:
    import torch

    from flywheel.trainer.engine import LoRASpec, LoRATrainer, _batch, samples_from_groups
    from flywheel.trainer.grpo import GRPOConfig

    trainer = LoRATrainer(resolve_model_dir(None), lora=LoRASpec(r=8), grpo=GRPOConfig(),
                          lr=1e-3, micro_batch=4)
    samples = samples_from_groups([g for _, g in groups[:2]], trainer.grpo)
    b = _batch(samples[:4], trainer.pad_id)
    with torch.no_grad():
        logp = trainer._logps(b, 1.0)
    diff = (logp - b["old"]).abs()[b["mask"]]
    assert float(diff.max()) < 1e-3  # LoRA starts at zero: ratio 1 against sampling
    before = [p.detach().clone() for p in trainer.model.parameters() if p.requires_grad]
    metrics = trainer.step([g for _, g in groups[:2]])
    assert all(v == v for v in metrics.values())  # no NaN
    assert abs(metrics["ratio_mean"] - 1.0) < 1e-3 and metrics["clip_frac"] == 0.0
    after = [p for p in trainer.model.parameters() if p.requires_grad]
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))


def torchrun(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """`torchrun --standalone --nproc_per_node=2 ARGS` on the CPU (gloo), one thread a rank."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc_per_node=2", "--max-restarts=0", *args],
            env={**os.environ, "OMP_NUM_THREADS": "1", **env}, stdout=out,
            stderr=subprocess.STDOUT)


def _demos() -> list[Demonstration]:
    return [Demonstration(
        messages=[{"role": "user", "content": f"What's the weather in {city}?"}], tools=TOOLS,
        reply=assistant_reply([("get_weather", {"city": city, "unit": "c"})]),
        source_trajectory_id=uuid.uuid4(), fingerprint=city, env="tool_call")
        for city in ["Oslo", "Lima", "Pune", "Quito"]]


def _two_gpus() -> bool:
    import torch

    return torch.cuda.device_count() >= 2


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not _two_gpus(), reason="NCCL ranks need two GPUs")])])
def test_torchrun_ranks_take_the_single_process_step(
        groups: list[tuple[TaskSpec, GroupScoredPayload]], tmp_path: Path, device: str) -> None:
    """Two ranks (gloo on CPUs; NCCL on two GPUs) resume a checkpoint, then SFT + GRPO steps
    with the batch split between them: the weights, optimizer moments and step count equal
    one CPU process doing the same."""
    import torch
    from safetensors.torch import load_file

    from flywheel.trainer.engine import LoRASpec, LoRATrainer, samples_from_groups
    from flywheel.trainer.grpo import GRPOConfig
    from flywheel.trainer.prefix import by_prompt
    from flywheel.trainer.ranks import balance
    from tests.support.dist_trainer_worker import run_ops

    model_dir = resolve_model_dir(None)
    payloads = [g for _, g in groups]
    torch.manual_seed(0)
    ref = LoRATrainer(model_dir, lora=LoRASpec(r=4), grpo=GRPOConfig(), lr=1e-3, micro_batch=2)
    ref.step(payloads[:2])
    ref.save(tmp_path / "ck")  # the followers must receive these weights and moments
    ops = [("sft", _demos()), ("grpo", payloads[2:6])]
    samples = samples_from_groups(payloads[2:6], ref.grpo)
    split = balance([1] * len(by_prompt([(s.prompt_ids, s.temperature) for s in samples])), 2)
    assert all(split), "both ranks must get a share of the GRPO batch"
    data = tmp_path / "data.pkl"
    data.write_bytes(pickle.dumps({"model_dir": model_dir, "resume": tmp_path / "ck",
                                   "ops": ops}))
    log = tmp_path / "torchrun.log"
    worker = Path(__file__).parent / "support" / "dist_trainer_worker.py"
    proc = torchrun([str(worker), str(data), str(tmp_path / "out"), device],
                    {"PYTHONPATH": str(worker.parents[2])}, log)
    assert proc.wait(300) == 0, log.read_text()[-4000:]
    run_ops(ref, ops)
    ref.save(tmp_path / "ref")

    got, want = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("out", "ref"))
    assert got.keys() == want.keys()
    start = load_file(tmp_path / "ck" / "adapter_model.safetensors")
    # Summation order differs (each rank's share, then the all-reduce), so equal up to
    # rounding: within 1% of what the steps moved each tensor (a step computed on a share
    # alone, or mis-weighted, is off by the order of the move itself).
    for k in want:
        moved = float((want[k] - start[k]).abs().max())
        assert moved > 1e-4, k
        assert float((got[k] - want[k]).abs().max()) < 0.01 * moved, k
    got_state, want_state = (torch.load(tmp_path / d / "trainer_state.pt", weights_only=True,
                                        map_location="cpu")
                             for d in ("out", "ref"))
    assert got_state["steps"] == want_state["steps"] == 3
    for i, s in want_state["optimizer"]["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            diff = (got_state["optimizer"]["state"][i][name] - s[name]).abs().max()
            assert float(diff) <= 0.01 * float(s[name].abs().max()), (i, name)


async def test_torchrun_trainer_stops_every_rank_while_waiting_for_the_baseline(
        settings: Settings, tmp_path: Path) -> None:
    """SIGTERM while rank 0 waits for the gate's baseline (its follower idle): rank 0 shuts
    down gracefully and its follower leaves on `stop`; nothing is left running."""
    assert settings.kafka.bootstrap
    s = settings.model_copy(update={
        "rollout": settings.rollout.model_copy(update={"model_dir": resolve_model_dir(None)}),
        "trainer": settings.trainer.model_copy(update={
            "adapters_dir": tmp_path / "adapters", "lora_r": 4})})
    await ensure_topics(s.kafka.bootstrap, s.topics.all(), partitions=1)
    log = tmp_path / "trainer.log"
    proc = torchrun(["-m", "consumers.trainer"], settings_env(s), log)
    try:
        deadline = asyncio.get_running_loop().time() + 120
        while "waiting for the gate's baseline" not in log.read_text():
            assert proc.poll() is None and asyncio.get_running_loop().time() < deadline, \
                log.read_text()[-3000:]
            await asyncio.sleep(0.2)
        ranks = _children(proc.pid)
        assert len(ranks) == 2
    finally:
        proc.terminate()
        proc.wait(60)
    out = log.read_text()
    assert "rank 1: stop after 0 steps" in out and "shut down gracefully" in out, out[-3000:]
    assert not [pid for pid in ranks if _running(pid)]


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _rank_of(pid: int) -> int:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(e for e in env if e.startswith(b"RANK=")).split(b"=", 1)[1])


@pytest.mark.parametrize("ranks", [1, 2], ids=["one-process", "torchrun-2-ranks"])
async def test_kill_and_resume_trains_every_group_exactly_once(
        groups: list[tuple[TaskSpec, GroupScoredPayload]], settings: Settings, db_url: str,
        pg_dsn: str, tmp_path: Path, ranks: int) -> None:
    """SIGKILL mid-way (under torchrun: the follower rank; rank 0's next collective fails and
    it exits, ending the job), restart: every group is trained into exactly one version.
    Under torchrun, SIGTERM then ends all ranks cleanly."""
    assert settings.kafka.bootstrap
    s = settings.model_copy(update={
        "rollout": settings.rollout.model_copy(update={
            "train_batch_groups": 2, "model_dir": resolve_model_dir(None)}),
        "trainer": settings.trainer.model_copy(update={
            "publish_every": 1, "adapters_dir": tmp_path / "adapters", "lora_r": 8,
            "stages": "grpo_only"})})
    await ensure_topics(s.kafka.bootstrap, s.topics.all(), partitions=1)
    engine = make_engine(db_url)
    async with engine.begin() as conn:
        for task, g in groups:
            await store_task(conn, task, uuid.uuid4(), "test", s.topics)
            from sqlalchemy import text

            await conn.execute(text("""INSERT INTO rollout_groups (group_id, task_id, env,
                scored, not_run, trainable, rollouts, worker, duration_ms)
                VALUES (:g, :t, 'tool_call', 4, 0, true, '[]', 'test', 1)"""),
                {"g": g.group_id, "t": task.task_id})
    await engine.dispose()
    producer = AIOKafkaProducer(bootstrap_servers=s.kafka.bootstrap)
    await producer.start()
    for _, g in groups:
        event = GroupScored(aggregate_id=str(g.task_id), payload=g)
        await producer.send_and_wait(s.topics.rollouts, event.model_dump_json().encode())
    await producer.stop()

    log = tmp_path / "trainer.log"

    def launch() -> subprocess.Popen[bytes]:
        if ranks == 1:
            return spawn("consumers.trainer", s, log)
        # A short process-group timeout: idle followers live on rank 0's pings alone.
        return torchrun(["-m", "consumers.trainer"],
                        {**settings_env(s), "FLYWHEEL_TRAINER__DIST_TIMEOUT_S": str(DIST_S)},
                        log)

    proc = launch()
    try:
        deadline = asyncio.get_running_loop().time() + 300
        while await scalar(pg_dsn, "SELECT count(*) FROM adapter_versions") < 1:
            assert proc.poll() is None and asyncio.get_running_loop().time() < deadline, \
                log.read_text()[-3000:]
            await asyncio.sleep(0.2)
        if ranks == 1:
            proc.send_signal(signal.SIGKILL)  # mid-way: version 1 out, step 2 under way
            proc.wait()
        else:  # the follower dies: the collective breaks and torchrun ends the whole job
            follower = next(c for c in _children(proc.pid) if _rank_of(c) == 1)
            os.kill(follower, signal.SIGKILL)
            assert proc.wait(120) != 0
        assert await scalar(pg_dsn, "SELECT count(*) FROM adapter_versions") < GROUPS // 2
        proc = launch()
        while await scalar(pg_dsn, "SELECT count(*) FROM adapter_versions") < GROUPS // 2:
            assert proc.poll() is None and asyncio.get_running_loop().time() < deadline, \
                log.read_text()[-3000:]
            await asyncio.sleep(0.2)
        # Nothing more may be published: every group is used up. Under torchrun, idle for
        # longer than the process group's timeout: the pings keep the followers in.
        await asyncio.sleep(3 if ranks == 1 else DIST_S * 1.2)
        assert proc.poll() is None, log.read_text()[-3000:]
    finally:
        proc.terminate()
        proc.wait(60)
    if ranks == 2:  # torchrun itself exits 1 on SIGTERM; the ranks stop cleanly
        text_ = log.read_text()
        assert "data-parallel trainer: 2 ranks" in text_
        assert "exiting so torchrun restarts the job" in text_  # rank 0 after rank 1 died
        last = text_[text_.rindex("death signal"):]
        assert "rank 1: stop after 3 steps" in last and "shut down gracefully" in last, last
    assert await scalar(pg_dsn, "SELECT count(*) FROM adapter_versions") == GROUPS // 2
    store = AdapterStore(tmp_path / "adapters")
    seen: list[str] = []
    parents = []
    for v in store.versions("policy"):
        _, manifest = store.load("policy", v)
        seen += [str(x) for x in manifest.groups_consumed]
        parents.append(manifest.parent_version)
    assert sorted(seen) == sorted(str(g.group_id) for _, g in groups)  # none lost or twice
    assert parents == [None, 1, 2]
    conn = await asyncpg.connect(pg_dsn)
    try:
        assert await conn.fetchval("SELECT count(*) FROM rollout_groups WHERE consumed_as = "
                                   "'trained' AND trained_version IS NOT NULL") == GROUPS
        assert await conn.fetchval(
            "SELECT count(*) FROM events WHERE type = 'AdapterTrained'") == GROUPS // 2
        status = await conn.fetchrow("SELECT state, version FROM trainer_status")
        assert status["version"] == GROUPS // 2 and status["state"] in {"stopped", "waiting"}
    finally:
        await conn.close()

    # A tampered artifact is refused at load, with the file named.
    weights = next(store.path("policy", 3).glob("adapter_model.*"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CorruptAdapter, match=weights.name):
        store.load("policy", 3)
    json.dumps(seen)
