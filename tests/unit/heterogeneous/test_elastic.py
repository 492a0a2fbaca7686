# SPDX-License-Identifier: Apache-2.0
"""Elastic runs (deepspeed/runtime/heterogeneous/elastic/): a checkpoint saved on one world loads
onto another by itself, exactly.

- A run on 3 ranks (plan [4, 3, 1], memory shares [0.5, 0.3, 0.2]) saves at step SAVE_AT and goes
  on to STEPS; the checkpoint, loaded with a plain ``engine.load_checkpoint(dir)`` on 2 ranks
  ([6, 2], shares [0.7, 0.3]) and on 4 ([3, 2, 2, 1], [0.4, 0.3, 0.2, 0.1]), ZeRO-1, 2 and 3, ends
  equal to the uninterrupted run (1e-6) after feeding the same samples at every step; one line
  says what changed; the second world reuses the first one's conversion.
- Re-partitioning switched off (``elastic.repartition: false``), upstream's refusal stands.
- The line's text, and the refusal of a combination the universal path does not carry, without
  processes.
"""

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from harness import REPO_ROOT, fork_environment, free_port, run_subcases
from references import adam_mse_reference

ELASTIC_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "elastic_train.py"


def _load_script():
    import importlib.util
    spec = importlib.util.spec_from_file_location("elastic_train", ELASTIC_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


script = _load_script()
WIDTH, SAMPLES, BATCH, LR = script.WIDTH, script.SAMPLES, script.BATCH, script.LR  # one epoch = 12 steps of 8
SAVE_AT = 3
STEPS = 7
PLANS = {world: script.PLANS[world] for world in (2, 3, 4)}
make_model = script.make_model
recording_dataset = script.samples


def elastic_config(world_size, stage, repartition=True):
    return script.config(world_size, stage, {"repartition": repartition})


def portable_config(stage):
    """A config that names no rank: compute_aware plans and memory-proportional shares decided from
    the devices present, as an elastic job should use (docs/elastic.md)."""
    return {"train_batch_size": BATCH, "steps_per_print": 1000, "gradient_clipping": 0.0,
            "optimizer": {"type": "Adam", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
            "zero_optimization": {"stage": stage},
            "heterogeneous_config": {"enabled": True, "mixed_precision_support": "fp32", "profile_steps": 2},
            "heterogeneous_memory": {"enabled": True, "zero_partitions": "auto"}}


def _train(rank, world_size, stage, folder, save=False, load=False, repartition=True, portable=False):
    """Steps 1..STEPS on 3 ranks, saving after SAVE_AT (``save``), or from the checkpoint to STEPS
    on this world (``load``). Returns each step's fed indices, the printed load line and the full
    fp32 parameters."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    dataset = recording_dataset()
    model = make_model()
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                config=portable_config(stage) if portable else
                                                elastic_config(world_size, stage, repartition),
                                                training_data=dataset)
    printed = ""
    if load:
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                engine.load_checkpoint(folder)
        except Exception as error:  # the parent checks the message
            return {"error": f"{type(error).__name__}: {error}"}
        printed = out.getvalue()
    first = engine.global_steps
    fed = []
    iterator = iter(loader)
    for step in range(first, STEPS):
        start = len(dataset.seen)
        for _ in range(engine.gradient_accumulation_steps()):
            inputs, targets = next(iterator)
            engine.backward(torch.nn.functional.mse_loss(engine(inputs), targets))
            engine.step()
        fed.append(dataset.seen[start:])
        if save and engine.global_steps == SAVE_AT:
            engine.save_checkpoint(folder)
    return {"fed": fed, "first": first, "printed": printed, "plan": list(engine.heterogeneous_plan.micro_batch_sizes),
            "params": [safe_get_full_fp32_param(p).clone() for p in engine.module.parameters()],
            "forwards": float(engine.module.forwards)}


def _steps(per_rank):
    """Per step, the sorted indices every rank fed."""
    return [sorted(i for rank in per_rank for i in rank["fed"][step]) for step in range(len(per_rank[0]["fed"]))]


@pytest.mark.multiprocess
def test_a_checkpoint_of_three_ranks_resumes_on_two_and_four_exactly(tmp_path):
    stages = (1, 2, 3)
    folders = {stage: str(tmp_path / f"zero{stage}") for stage in stages}
    saved = run_subcases(_train, [dict(stage=s, folder=folders[s], save=True) for s in stages], world_size=3,
                         timeout=600)
    resumed = {}
    for world in (2, 4):
        cases = [dict(stage=s, folder=folders[s], load=True) for s in stages]
        if world == 2:  # re-partitioning switched off: upstream's refusal stands
            cases.append(dict(stage=2, folder=folders[2], load=True, repartition=False))
        runs = run_subcases(_train, cases, world_size=world, timeout=600)
        resumed[world] = dict(zip(stages, runs))
        if world == 2:
            for rank_result in runs[-1]:
                assert "DP world size of 3 but the current world size is 2" in rank_result.get("error", ""), rank_result
    dataset = recording_dataset()
    for stage, uninterrupted in zip(stages, saved):
        steps = _steps(uninterrupted)
        fed = [i for step in steps for i in step]
        assert len(fed) == len(set(fed)) == STEPS * BATCH, "each index once"
        reference = adam_mse_reference(make_model(), dataset.inputs, dataset.targets, steps, LR)
        for got, want in zip(uninterrupted[0]["params"], reference):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        for world in (2, 4):
            per_rank = resumed[world][stage]
            for rank_result in per_rank:
                assert "params" in rank_result, (stage, world, rank_result)
            first = per_rank[0]
            assert first["first"] == SAVE_AT and first["plan"] == PLANS[world][0]
            assert _steps(per_rank) == steps[SAVE_AT:], f"ZeRO-{stage} on {world} ranks fed other samples"
            for rank_result in per_rank:
                assert rank_result["forwards"] == STEPS, "the buffer restored from the checkpoint, then counted on"
                for got, want in zip(rank_result["params"], uninterrupted[0]["params"]):
                    torch.testing.assert_close(got, want, rtol=0, atol=1e-6,
                                               msg=lambda m: f"ZeRO-{stage} resumed on {world} ranks: {m}")
            line = first["printed"]
            assert f"saved on 3 ranks [4, 3, 1], resumed on {world} {PLANS[world][0]}" in line, line
            assert f"ZeRO-{stage} optimizer state re-partitioned" in line, line
            assert "the samplers continue at round 3 of epoch 0" in line, line
            # The first world converts the tag; the second loads the same universal folder.
            assert ("converted in" if world == 2 else "converted by an earlier load") in line, line
            assert all(r["printed"] == "" for r in per_rank[1:]), "one rank prints"


@pytest.mark.multiprocess
def test_a_config_that_names_no_rank_resumes_on_another_world_exactly(tmp_path):
    """compute_aware and memory shares from the devices: saved on 3 ranks, resumed on 2; the plan
    and shares are whatever the devices give (timing), so the check is the reference on the samples
    fed and that each was fed once."""
    folder = str(tmp_path / "portable")
    (saved, ) = run_subcases(_train, [dict(stage=2, folder=folder, save=True, portable=True)], world_size=3,
                             timeout=600)
    (resumed, ) = run_subcases(_train, [dict(stage=2, folder=folder, load=True, portable=True)], world_size=2,
                               timeout=600)
    assert "re-partitioned" in resumed[0]["printed"] or "saved on 3 ranks" in resumed[0]["printed"], resumed[0]
    steps = _steps(saved)[:SAVE_AT] + _steps(resumed)
    fed = [i for step in steps for i in step]
    assert len(steps) == STEPS and len(fed) == len(set(fed)) == STEPS * BATCH
    dataset = recording_dataset()
    reference = adam_mse_reference(make_model(), dataset.inputs, dataset.targets, steps, LR)
    for rank_result in resumed:
        for got, want in zip(rank_result["params"], reference):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


# -- periodic checkpoints with upstream's decoupled writer -----------------------------------------

def _periodic(rank, world_size, folder, decoupled, load=False, every_seconds=None):
    """ZeRO-2 on [6, 2], saving every 3 steps by itself; records what ``latest`` names after each
    step. ``load``: resume from ``latest`` and train to STEPS."""
    import os

    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    config = elastic_config(world_size, 2)
    config["heterogeneous_config"]["elastic"]["checkpoint"] = (
        {"dir": folder, "every_steps": 3, "keep_last": 1} if every_seconds is None else
        {"dir": folder, "every_seconds": every_seconds, "keep_last": 1})
    if decoupled:
        config["checkpoint"] = {"writer": {"decoupled": True, "type": "PYTHON", "data_parallel": "REPLICA"}}
    dataset = recording_dataset()
    model = make_model()
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                                training_data=dataset)
    if load:
        engine.load_checkpoint(folder)
    latest, iterator = [], iter(loader)
    while engine.global_steps < STEPS:
        inputs, targets = next(iterator)
        engine.backward(torch.nn.functional.mse_loss(engine(inputs), targets))
        try:
            engine.step()
        except ValueError as error:  # the parent checks the message
            return {"error": str(error)}
        path = os.path.join(folder, "latest")
        latest.append(open(path).read() if os.path.exists(path) else None)
    return {"latest": latest, "tags": sorted(os.listdir(folder)),
            "params": [safe_get_full_fp32_param(p).clone() for p in engine.module.parameters()]}


@pytest.mark.multiprocess
def test_periodic_checkpoints_publish_latest_once_complete_and_refuse_the_decoupled_writer(tmp_path):
    """Every 3 steps, keeping 1: ``latest`` names each tag after the step that saved it, older tags
    are removed, and a run resumed from ``latest`` ends equal to the one that saved. Upstream's
    decoupled writer (whose files are written after save_checkpoint returns) is refused on every rank."""
    folder = str(tmp_path / "sync")
    # Upstream's decoupled writer reads the machine count and rank the deepspeed launcher exports.
    launcher_env = {"CROSS_SIZE": "1", "CROSS_RANK": "0"}
    cases = [dict(folder=folder, decoupled=False), dict(folder=str(tmp_path / "decoupled"), decoupled=True),
             dict(folder=str(tmp_path / "timed"), decoupled=False, every_seconds=1e-6)]
    saved, refused, timed = run_subcases(_periodic, cases, world_size=2, timeout=600, env=launcher_env)
    assert saved[0]["latest"] == [None, None] + ["global_step3"] * 3 + ["global_step6"] * 2
    # By time: a period shorter than any step, agreed at every boundary: a save after each step.
    assert timed[0]["latest"] == [f"global_step{step}" for step in range(1, STEPS + 1)], timed[0]["latest"]
    assert [t for t in timed[0]["tags"] if t.startswith("global_step")] == [f"global_step{STEPS}"]
    assert [t for t in saved[0]["tags"] if t.startswith("global_step")] == ["global_step6"], saved[0]
    for rank_result in refused:
        assert "cannot be used with checkpoint.writer.decoupled: true" in rank_result.get("error", ""), rank_result
    (resumed, ) = run_subcases(_periodic, [dict(folder=folder, decoupled=False, load=True)], world_size=2,
                               timeout=600)
    for got, want in zip(resumed[0]["params"], saved[0]["params"]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


# -- a node lost under torchrun ---------------------------------------------------------------------

def run_elastic_job(out, steps=10, every=2, kill_at=5, step_sleep=0.0, timeout=420):
    """Three torchrun agents of one elastic job (``--nnodes 2:3``, one worker each, c10d rendezvous
    hosted by the first); the third is the victim. Returns the agents' exit codes, their output,
    the events and the seconds the job took."""
    port = free_port()
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE: the workers' store is their rank 0's, new in every round.
    # The agents' shared store (the default) keeps the keys of the round before, and the restarted
    # workers' gloo then connects to the addresses of the killed ones (docs/elastic.md).
    env = {**os.environ, **fork_environment(), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    agents, logs = [], []
    began = time.time()
    for index in range(3):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2:3", "--nproc-per-node", "1",
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"elastic{port}",
                   "--rdzv-conf", f"is_host={int(index == 0)},join_timeout=120,last_call_timeout=10,"
                   "keep_alive_interval=1,keep_alive_max_attempt=3",
                   "--max-restarts", "3", "--monitor-interval", "0.2",
                   str(ELASTIC_SCRIPT), "--out", str(out), "--steps", str(steps), "--every", str(every),
                   "--kill-at", str(kill_at), "--step-sleep", str(step_sleep)]
        log = open(out / f"agent{index}.log", "w")
        logs.append(log)
        agents.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                       env={**env, "ELASTIC_VICTIM": "1" if index == 2 else "0"},
                                       start_new_session=True))
        if index == 0:
            _wait_for_port(port, 60)
    codes = []
    try:
        for agent in agents:
            codes.append(agent.wait(timeout=max(1, timeout - (time.time() - began))))
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
        for log in logs:
            log.close()
    seconds = time.time() - began
    output = [(out / f"agent{index}.log").read_text() for index in range(3)]
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines() if line.strip()]
    return codes, output, events, seconds


def _wait_for_port(port, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"the rendezvous store did not listen on port {port} within {timeout} s")


def effective_steps(events):
    """Per optimizer step of the finished run, the sorted indices the ranks fed, from the attempts
    that led to it: each attempt's steps up to the step the next attempt loaded."""
    attempts = sorted({e["attempt"] for e in events})
    loaded = {e["attempt"]: e["step"] for e in events if e["kind"] == "loaded" and e["rank"] == 0}
    steps = {}
    for attempt in attempts:
        later = [loaded.get(a, 0) for a in attempts if a > attempt]
        kept_to = later[0] if later else None
        for e in events:
            if e["kind"] == "step" and e["attempt"] == attempt and (kept_to is None or e["step"] <= kept_to):
                steps.setdefault(e["step"], {}).setdefault(attempt, []).extend(e["fed"])
    return [sorted(steps[s][max(steps[s])]) for s in sorted(steps)]


@pytest.mark.multiprocess
def test_a_lost_node_ends_the_job_on_the_survivors_exactly(tmp_path):
    """Three agents, one worker each; after step 5 the third kills its agent and itself. The two
    others restart by themselves on 2 ranks from the checkpoint of step 4 (saved on 3 ranks,
    re-partitioned), finish the 10 steps and exit 0; the final parameters equal one process's Adam
    on the global batches the finished run was made of, and each sample was used once."""
    codes, output, events, _ = run_elastic_job(tmp_path)
    text = "\n".join(output)
    assert codes[0] == 0 and codes[1] == 0 and codes[2] != 0, (codes, text[-8000:])
    kills = [e for e in events if e["kind"] == "kill"]
    assert len(kills) == 1 and kills[0]["world"] == 3 and kills[0]["step"] == 5, (kills, text[-4000:])
    finished = max(e["attempt"] for e in events if e["kind"] == "done")
    done = [e for e in events if e["kind"] == "done"]
    assert {e["world"] for e in done} == {2} and len(done) == 2, done
    loads = [e for e in events if e["kind"] == "loaded" and e["attempt"] == finished]
    assert loads and all(e["step"] == 4 for e in loads), loads
    assert "saved on 3 ranks [4, 3, 1], resumed on 2 [6, 2]" in loads[0]["printed"] + loads[1]["printed"], loads
    steps = effective_steps(events)
    assert len(steps) == 10
    fed = [i for step in steps for i in step]
    assert len(fed) == len(set(fed)) == 10 * BATCH, "each sample once"
    # The steps redone after the restart fed what the 3-rank attempt had fed at steps 5 (and beyond).
    first = {e["step"]: e for e in events if e["kind"] == "step" and e["world"] == 3}
    redone = sorted(i for e in events if e["kind"] == "step" and e["attempt"] == finished and e["step"] == 5
                    for i in e["fed"])
    assert redone == sorted(i for e in events if e["kind"] == "step" and e["world"] == 3 and e["step"] == 5
                            for i in e["fed"]), first.keys()
    final = torch.load(tmp_path / "final.pt")
    dataset = recording_dataset()
    reference = adam_mse_reference(make_model(), dataset.inputs, dataset.targets, steps, LR)
    for got, want in zip(final["params"], reference):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


# -- the parts without processes --------------------------------------------------------------------

def test_old_tags_are_removed_but_never_the_latest():
    from deepspeed.runtime.heterogeneous.elastic.periodic import tags_to_remove
    names = ["global_step10", "global_step2", "global_step4.universal", "global_step4", "latest", "global_step8",
             "zero_to_fp32.py", "global_stepX"]
    assert tags_to_remove(names, 2, "global_step10") == ["global_step2", "global_step4"]
    assert tags_to_remove(names, 2, "global_step4") == ["global_step2"]  # latest names an older tag: kept
    assert tags_to_remove(names, 0, "global_step10") == []
    assert tags_to_remove(names, 5, "global_step10") == []


def test_latest_is_replaced_in_one_rename(tmp_path):
    from deepspeed.runtime.heterogeneous.elastic.periodic import write_latest
    write_latest(str(tmp_path), "global_step4")
    write_latest(str(tmp_path), "global_step6")
    assert (tmp_path / "latest").read_text() == "global_step6"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]


def test_time_checks_are_spaced_by_the_gathered_step_time():
    from deepspeed.runtime.heterogeneous.elastic.periodic import next_time_check
    assert next_time_check(elapsed=10.0, steps=10, every_seconds=100.0) == 45  # half of the 90 steps left
    assert next_time_check(elapsed=99.0, steps=10, every_seconds=100.0) == 1
    assert next_time_check(elapsed=0.0, steps=0, every_seconds=100.0) == 1


def test_the_shared_rendezvous_store_is_named_where_a_restart_would_fail():
    from deepspeed.runtime.heterogeneous.elastic.periodic import shared_store_breaks_restarts
    assert shared_store_breaks_restarts({"TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert not shared_store_breaks_restarts({"TORCHELASTIC_MAX_RESTARTS": "3",
                                             "TORCHELASTIC_USE_AGENT_STORE": "False"})
    assert not shared_store_breaks_restarts({"TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert not shared_store_breaks_restarts({})


def test_the_world_change_line():
    from deepspeed.runtime.heterogeneous.checkpoint import world_change_line
    saved, current = _plan([4, 3, 1]), _plan([6, 2])
    elastic = {"stage": 3, "saved_shares": [0.5, 0.3, 0.2], "shares": None, "path": "/c/global_step4.universal",
               "seconds": 3.14, "converted": True}
    line = world_change_line(saved, current, elastic, [{"rounds_done": 4, "epoch": 1}])
    assert line == ("saved on 3 ranks [4, 3, 1], resumed on 2 [6, 2]; ZeRO-3 optimizer state re-partitioned (shares "
                    "[0.50, 0.30, 0.20] -> equal) through the universal checkpoint /c/global_step4.universal, "
                    "converted in 3.1 s; the samplers continue at round 4 of epoch 1")
    assert world_change_line(saved, _plan([8, 8]), None, []) == ("saved on 3 ranks [4, 3, 1], resumed on 2 [8, 8] "
                                                                 "(train_batch_size 8 -> 16)")


def _plan(sizes):
    from deepspeed.runtime.heterogeneous.planning.plan import Plan
    return Plan(micro_batch_sizes=sizes, gradient_accumulation_steps=[1] * len(sizes), train_batch_size=sum(sizes),
                strategy="manual", predicted_rank_times=[0.0] * len(sizes))


@pytest.mark.parametrize("block, expected", [
    ({"checkpoint": {"dir": "/c"}}, "heterogeneous_config.elastic.checkpoint: set every_steps, every_seconds or both"),
    ({"checkpoint": {"dir": "/c", "every_steps": 0}}, "heterogeneous_config.elastic.checkpoint.every_steps"),
    ({"checkpoint": {"every_steps": 2}}, "heterogeneous_config.elastic.checkpoint.dir"),
    ({"repartition": "yes please"}, "heterogeneous_config.elastic.repartition"),
])
def test_a_wrong_elastic_block_is_named(block, expected):
    from deepspeed.runtime.heterogeneous.config.settings import load_heterogeneous_settings
    with pytest.raises(ValueError) as info:
        load_heterogeneous_settings({"heterogeneous_config": {"enabled": True, "elastic": block}}, environ={})
    assert expected in str(info.value), str(info.value)
