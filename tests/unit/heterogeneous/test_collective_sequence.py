# SPDX-License-Identifier: Apache-2.0
"""Every rank issues the same collectives (docs/architecture.md, "Invariants"), whatever its own micro-batch.

Each rank records its sequence of ``deepspeed.comm`` collectives (``measure/collective_log.py``) from
``deepspeed.initialize`` to the last step; the parent compares the ranks' sequences op by op:
the op, the group, every tensor's shape and dtype, the reduce op and root, async or not. Cases:
an uneven manual plan in ZeRO 0-3 with accumulation and clipping; compute_aware with profiling
re-plans and an on-demand re-plan (the fork's own gathers and broadcasts); fp16 with the adaptive
loss scaler and an overflow on one rank only; per-rank accumulation that memory limits force in
ZeRO-1; uneven ZeRO-1/2 partitions (0.7, 0.3); upstream alone (fork off), recorded through the
listener only. A last case makes one rank issue an extra collective, so the comparison is seen to
fail. All cases share one 2-rank group (about 20 s on an idle machine).
"""

import pytest
import torch

from deepspeed.runtime.heterogeneous.measure.collective_log import (Collective, assert_same_collectives, describe,
                                                                    first_mismatch, mismatch_report)
from harness import run_subcases

WIDTH, HIDDEN = 64, 256
DATASET = 160
LR = 1e-3
ADAM = {"type": "Adam", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}}

# -- the pure part --------------------------------------------------------------------------------


def test_an_entry_keeps_what_pairs_collectives_and_drops_what_may_differ():
    from deepspeed.comm import ReduceOp
    reduce = describe("all_reduce", {"tensor": torch.zeros(2, 3), "op": ReduceOp.MAX, "group": None,
                                     "async_op": True, "prof": False, "log_name": "x", "debug": "caller"}, [0, 1])
    assert reduce == Collective("all_reduce", (0, 1), (("tensor", ((2, 3), "float32")),), (("op", "MAX"),), True)
    assert str(reduce) == "all_reduce(group=[0, 1], tensor=float32[2, 3], op=MAX) async"
    # Object collectives: pickled payloads differ per rank, the length of the list does not.
    mine = describe("all_gather_object", {"object_list": [None, None], "obj": {"rank": 0, "t": 1.5}}, range(2))
    theirs = describe("all_gather_object", {"object_list": [None, None], "obj": [1, 2, 3]}, range(2))
    assert mine == theirs and str(mine) == "all_gather_object(group=[0, 1], objects=2)"
    # A list of tensors keeps each shape; another dtype or shape is another collective.
    gather = describe("all_gather", {"tensor_list": [torch.zeros(4)] * 2, "tensor": torch.zeros(4)}, [0, 1])
    assert str(gather) == "all_gather(group=[0, 1], tensor_list=[float32[4], float32[4]], tensor=float32[4])"
    assert describe("all_reduce", {"tensor": torch.zeros(3, dtype=torch.float16)}, [0, 1]) != \
        describe("all_reduce", {"tensor": torch.zeros(3)}, [0, 1])
    assert describe("broadcast", {"tensor": torch.zeros(3), "src": 0}, [0, 1]) != \
        describe("broadcast", {"tensor": torch.zeros(3), "src": 1}, [0, 1])


def test_the_report_names_the_first_differing_index_and_both_entries():
    a = describe("all_reduce", {"tensor": torch.zeros(8)}, [0, 1])
    b = describe("all_reduce", {"tensor": torch.zeros(9)}, [0, 1])
    c = describe("barrier", {}, [0, 1])
    assert first_mismatch([[a, c], [a, c]]) is None and mismatch_report([[a, c], [a, c]]) == ""
    assert first_mismatch([[a, a, c], [a, b, c]]) == 1
    report = mismatch_report([[a, a, c], [a, b, c]])
    assert "differ at index 1" in report
    assert "[1] rank 0: all_reduce(group=[0, 1], tensor=float32[8])" in report
    assert "[1] rank 1: all_reduce(group=[0, 1], tensor=float32[9])" in report
    # One rank stopping early is a mismatch at its end.
    report = mismatch_report([[a, c], [a]])
    assert "differ at index 1" in report and "[1] rank 1: <no more collectives>" in report
    with pytest.raises(AssertionError, match="fp16: collective sequences differ at index 0"):
        assert_same_collectives([[a], [b]], what="fp16")


def test_a_listener_sees_each_collective_and_leaves_the_clock_as_it_was():
    from deepspeed.runtime.heterogeneous.measure import comm_clock, collective_log

    def collective(tensor, async_op=False):
        return tensor + 1

    seen, enabled_before, total_before = [], comm_clock.enabled, comm_clock.seconds_in_collectives()
    comm_clock.set_listener(lambda func, args, kwargs: seen.append((func, args, kwargs)))
    try:
        assert comm_clock.enabled  # timed_op routes through timed_call while a listener is set
        assert comm_clock.timed_call(collective, 1, async_op=True) == 2  # results pass through unwrapped
        with pytest.raises(RuntimeError, match="already running"):
            with collective_log.recording():
                pass
    finally:
        comm_clock.set_listener(None)
    assert seen == [(collective, (1, ), {"async_op": True})]
    assert comm_clock.enabled == enabled_before  # off again unless a heterogeneous config started the clock
    if not comm_clock._timing:
        assert comm_clock.seconds_in_collectives() == total_before  # a listener alone times nothing


# -- every rank's sequence while training ----------------------------------------------------------


def make_model():
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, WIDTH))


def dataset():
    generator = torch.Generator().manual_seed(3)
    return torch.utils.data.TensorDataset(torch.arange(DATASET), torch.randn(DATASET, WIDTH, generator=generator),
                                          torch.randn(DATASET, WIDTH, generator=generator))


def _manual(rank, entries, stage, gas=2, sizes=(5, 3), steps=3, fp16=False, overflow_at=None,
            extra_collective_at=None, shares=None):
    """An uneven manual plan fed by hand (each rank its slice of the global micro-batch);
    ``extra_collective_at``: after that step rank 1 issues a collective rank 0 does not."""
    import deepspeed
    from deepspeed import comm as dist

    config = {"train_batch_size": sum(sizes) * gas, "gradient_accumulation_steps": gas, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": stage}, "optimizer": ADAM,
              "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "manual",
                                       "micro_batch_sizes": list(sizes)}}
    if shares:
        config["heterogeneous_memory"] = {"zero_partitions": list(shares)}
    if fp16:
        from deepspeed.accelerator import get_accelerator
        accelerator = get_accelerator()
        if accelerator.device_name() == "cpu" and not accelerator.is_fp16_supported():
            type(accelerator).is_fp16_supported = lambda self: True  # torch's CPU kernels run fp16
        config["fp16"] = {"enabled": True, "auto_scale_threshold": 0.95, "initial_scale_power": 16}
    model = make_model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    lonely = dist.new_group([1]) if extra_collective_at is not None else None  # every rank creates a group
    _, inputs, targets = dataset().tensors
    offset, per_micro, extra_index = sum(sizes[:rank]), sum(sizes), None
    for step in range(steps):
        for micro in range(gas):
            start = (step * gas + micro) * per_micro + offset
            chunk = slice(start, start + sizes[rank])
            x = inputs[chunk].half() if fp16 else inputs[chunk]
            loss = torch.nn.functional.mse_loss(engine(x).float(), targets[chunk])
            if step == overflow_at and rank == 1:
                loss = loss * float("inf")  # an overflow on one rank: every rank must skip together
            engine.backward(loss)
            engine.step()
        if step == extra_collective_at and rank == 1:
            extra_index = len(entries)
            dist.all_reduce(torch.ones(3), group=lonely)  # a collective rank 0 does not issue
    info = {"extra_index": extra_index}
    if shares:
        info["partition"] = [int(g.numel()) for g in engine.optimizer.single_partition_of_fp32_groups]
    if fp16:
        scaler = getattr(engine.optimizer, "adaptive_scaler", None) or engine.optimizer.loss_scaler
        info["scaler"] = type(scaler).__name__
        info["skipped"] = engine.skipped_steps
    return info


def _compute_aware(rank, entries, stage, steps=7, reschedule_at=5):
    """Profiling re-plans, then an on-demand re-plan, the engine's loader following the plan."""
    import deepspeed

    config = {"train_batch_size": 16, "gradient_clipping": 1.0, "zero_optimization": {"stage": stage},
              "optimizer": ADAM,
              "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "compute_aware",
                                       "profile_steps": 3, "scheduler": {"imbalance_threshold": 0.01},
                                       "emulation": {"speeds": [1.0, 0.25], "mode": "dilation"}}}
    model = make_model()
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                                training_data=dataset())
    plans, batches = [], iter(loader)
    for step in range(steps):
        if step == reschedule_at:
            sizes = engine.heterogeneous_plan.micro_batch_sizes
            # rank 1 three times as slow per sample as rank 0, whatever the plan is now
            engine.reschedule_workload([n * t for n, t in zip(sizes, [1.0, 3.0])])
        plans.append(list(engine.heterogeneous_plan.micro_batch_sizes))
        _, inputs, targets = next(batches)
        engine.backward(torch.nn.functional.mse_loss(engine(inputs), targets))
        engine.step()
    return {"plans": plans}


def _stock_resplit(rank, entries, stage, steps=7, reschedule_at=5):
    """A stock loader's equal batches re-split by the engine (profiling, then an on-demand
    re-plan), the loss computed outside the model: every rank moves inputs, returns outputs and
    exchanges their gradients the same way, whatever it was fed or computes."""
    import deepspeed

    config = {"train_batch_size": 16, "gradient_clipping": 1.0, "zero_optimization": {"stage": stage},
              "optimizer": ADAM,
              "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "compute_aware",
                                       "profile_steps": 3, "scheduler": {"imbalance_threshold": 0.01},
                                       "emulation": {"speeds": [1.0, 0.1], "mode": "dilation"}}}
    model = make_model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    _, inputs, targets = dataset().tensors
    plans = []
    for step in range(steps):
        if step == reschedule_at:
            engine.reschedule_workload([1.0, 0.05])  # rank 1 now the faster
        plans.append(list(engine.heterogeneous_plan.micro_batch_sizes))
        chunk = slice(step * 16 + rank * 8, step * 16 + rank * 8 + 8)  # equal shares, whatever the plan
        engine.backward(torch.nn.functional.mse_loss(engine(inputs[chunk]), targets[chunk]))
        engine.step()
    runtime = engine._heterogeneous_runtime()
    return {"plans": plans, "moved": runtime.exchange.input_bytes + runtime.exchange.output_bytes}


def _per_rank_gas(rank, entries, stage, caps=(2, 3), steps=5):
    """Emulated memory holds 2 and 3 samples: the plan accumulates a different number of
    micro-steps on each rank (ZeRO-0/1 only), the engine's loader feeding them."""
    import deepspeed
    from deepspeed.runtime.heterogeneous.measure.devices import BYTES_PER_GB
    from harness import predicted_state_bytes

    per_sample = (WIDTH + HIDDEN + WIDTH + WIDTH) * 4  # saved activations (see test_memory.py)
    state = predicted_state_bytes(make_model(), stage, 2, ADAM)
    # 17 is prime: no equal gas fits 2 + 3 samples per micro-step, so the ranks' gas must differ.
    config = {"train_batch_size": 17, "gradient_clipping": 1.0, "zero_optimization": {"stage": stage},
              "optimizer": ADAM, "heterogeneous_memory": {"hbm_utilization_threshold": 1.0},
              "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "compute_aware",
                                       "profile_steps": 3, "emulation": {
                                           "memory_gb": [(state + per_sample * (cap + 0.5)) / BYTES_PER_GB
                                                         for cap in caps], "mode": "dilation"}}}
    model = make_model()
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                                training_data=dataset())
    batches, micro_steps = iter(loader), [0] * steps
    while engine.global_steps < steps:
        _, inputs, targets = next(batches)
        micro_steps[engine.global_steps] += 1
        engine.backward(torch.nn.functional.mse_loss(engine(inputs), targets))
        engine.step()
    return {"plan": engine.heterogeneous_plan.to_dict(), "micro_steps": micro_steps}


def _fork_off(rank, entries, stage, steps=2):
    """Upstream alone (the case runs first, before any heterogeneous config started the clock):
    the recorder sees collectives through the listener alone, and async handles stay unwrapped."""
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.runtime.heterogeneous.measure import comm_clock

    config = {"train_batch_size": 8, "zero_optimization": {"stage": stage}, "optimizer": ADAM}
    model = make_model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    _, inputs, targets = dataset().tensors
    for step in range(steps):
        chunk = slice(step * 8 + rank * 4, step * 8 + rank * 4 + 4)
        engine.backward(torch.nn.functional.mse_loss(engine(inputs[chunk]), targets[chunk]))
        engine.step()
    handle = dist.all_reduce(torch.ones(2), async_op=True)
    handle.wait()
    return {"clock_running": comm_clock._timing, "handle_wrapped": isinstance(handle, comm_clock.TimedWork)}


_CASES = {"manual": _manual, "compute_aware": _compute_aware, "per_rank_gas": _per_rank_gas, "fork_off": _fork_off,
          "stock_resplit": _stock_resplit}


def record_case(rank, world_size, kind, **params):
    """This rank's collectives from ``deepspeed.initialize`` to the last step, and what the case
    reports about itself (so the parent can check the case did what it is meant to provoke)."""
    from deepspeed.runtime.heterogeneous.measure.collective_log import recording

    with recording() as entries:
        info = _CASES[kind](rank, entries, **params)
    return {"entries": list(entries), "info": info}


CASES = {
    "fork off, zero2 (listener only)": dict(kind="fork_off", stage=2),  # first: no clock running yet
    **{f"manual [5, 3] zero{stage} gas 2 clipping": dict(kind="manual", stage=stage) for stage in (0, 1, 2, 3)},
    "compute_aware zero2 profiling + reschedule_workload": dict(kind="compute_aware", stage=2),
    **{f"fp16 adaptive scaler zero{stage}, overflow on rank 1": dict(kind="manual", stage=stage, gas=1, steps=4,
                                                                     fp16=True, overflow_at=2) for stage in (0, 2, 3)},
    "per-rank gas zero1 (emulated memory)": dict(kind="per_rank_gas", stage=1),
    "stock loader re-split zero2, loss outside, profiling + reschedule_workload": dict(kind="stock_resplit", stage=2),
    **{f"uneven ZeRO partitions [0.7, 0.3] zero{stage}": dict(kind="manual", stage=stage, shares=(0.7, 0.3))
       for stage in (1, 2)},
    "negative: rank 1 issues an extra all_reduce": dict(kind="manual", stage=0, steps=2, extra_collective_at=0),
}


@pytest.fixture(scope="module")
def recorded():
    names = list(CASES)
    results = run_subcases(record_case, [CASES[name] for name in names], world_size=2, timeout=400)
    return dict(zip(names, results))


def _ops(entries):
    return {entry.op for entry in entries}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [name for name in CASES if not name.startswith("negative")])
def test_every_rank_issues_the_same_collectives(recorded, name):
    first, second = recorded[name]
    sequences = [first["entries"], second["entries"]]
    assert len(sequences[0]) > 0, name
    assert_same_collectives(sequences, what=name)
    ops = _ops(sequences[0])
    case = CASES[name]
    if case["kind"] == "fork_off":
        assert first["info"] == {"clock_running": False, "handle_wrapped": False}, first["info"]
        assert sequences[0][-1] == describe("all_reduce", {"tensor": torch.ones(2), "op": "SUM", "async_op": True},
                                            [0, 1]), sequences[0][-1]
    if case["kind"] in ("compute_aware", "per_rank_gas"):
        # The fork's own agreements (device gather at initialize, measurements, rank 0's plans).
        assert {"all_gather_object", "broadcast_object_list"} <= ops, (name, ops)
    if case["kind"] == "compute_aware":
        plans = first["info"]["plans"]
        # The plan did change while recorded: reschedule_workload's times (rank 1 three times as
        # slow per sample, whatever profiling measured) leave [12, 4], never the start-up plan.
        assert plans[-1] == [12, 4] and plans[0] != plans[-1], plans
    if case["kind"] == "stock_resplit":
        plans = first["info"]["plans"]
        # reschedule_workload's times make rank 1 the faster, whatever profiling measured before:
        # the re-plan moves work to it, and the stock loader's equal batches are re-split.
        assert plans[-1][1] > plans[-1][0], plans
        assert first["info"]["moved"] > 0 and second["info"]["moved"] > 0, (first["info"], second["info"])
        assert "all_gather" in ops, ops
    if case.get("fp16"):
        assert first["info"]["scaler"] == "AdaptiveLossScaler", first["info"]
        # rank 1's overflow skipped the step on both ranks (the first steps may overflow too)
        assert first["info"]["skipped"] == second["info"]["skipped"] >= 1, (first["info"], second["info"])
    if case.get("shares"):
        # The slices really differ (and the parameters' all-gather runs as per-owner broadcasts).
        assert first["info"]["partition"][0] > 2 * second["info"]["partition"][0], (first["info"], second["info"])
        assert "broadcast" in ops, ops
    if case["kind"] == "per_rank_gas":
        gas = first["info"]["plan"]["gradient_accumulation_steps"]
        assert len(set(gas)) > 1, f"memory caps did not provoke per-rank gas: {first['info']['plan']}"
        assert first["info"]["micro_steps"][-1] != second["info"]["micro_steps"][-1], \
            (first["info"]["micro_steps"], second["info"]["micro_steps"])


@pytest.mark.multiprocess
def test_an_extra_collective_on_one_rank_is_reported_at_its_index(recorded):
    first, second = recorded["negative: rank 1 issues an extra all_reduce"]
    index = second["info"]["extra_index"]
    assert index is not None and index > 0
    with pytest.raises(AssertionError) as failure:
        assert_same_collectives([first["entries"], second["entries"]], what="negative")
    report = str(failure.value)
    assert f"differ at index {index}" in report, report
    assert f"[{index}] rank 1: all_reduce(group=[1], tensor=float32[3], op=SUM)" in report, report
    assert f"[{index}] rank 0: " in report and "lengths: rank 0: " in report, report
