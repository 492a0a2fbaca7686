# SPDX-License-Identifier: Apache-2.0
"""A busy neighbour beside the fast rank: the plan is never worse than uniform, measured.

A new user's machine was busy. Rank 1 was emulated at half speed by a CPU quota (the default
``cgroup`` mode), while outside load slowed rank 0, which no quota limits; profiling then adopted
[1, 127], all the work on the rank emulated as the slow one. Here each rank is pinned to a core of
its own and two spinning processes share rank 0's core, so rank 0 gets about a third of it and
rank 1 its quota of half a core: the rank emulated as the fast one is the slower. Whatever plan
profiling adopts (rank 0 measures 1.7-4.3x slower; [1, 15] may well be the faster plan), the
switch check (on without dynamic rebalancing) sends it back if it made the step slower.

Both runs happen in one group, under the same neighbour: the uniform plan (manual [8, 8]) and
the fork's compute_aware plan. The measured step time at the plan in force at the end must not be
worse than uniform's beyond the timing noise of a loaded 2-core machine.
"""

import os
import statistics
import subprocess
import sys
import time

import pytest
import torch

from harness import run_subcases

WIDTH, HIDDEN, BATCH, PROFILE, CHECK_INTERVAL, STEPS = 512, 4096, 16, 5, 4, 24
LAST = 8  # the steps at the plan that stays (after profiling, its check and a comparison: 13 steps)
TOLERANCE = 0.35
"""Step-time noise between two runs under the spinning neighbours (medians of 8 steps of ~80 ms:
up to +-20% seen). What the test guards against is far beyond it: [1, 127] ran several times
uniform's step time, and [3, 13], which the switch check used to keep here, +16% to +42%."""


def _cpu_cgroups_unusable():
    if os.geteuid() != 0:
        return "not root"
    from deepspeed.runtime.heterogeneous.measure.cgroup_files import find_hierarchy
    if find_hierarchy("cpu") is None:
        return "no cpu cgroup controller"
    if len(os.sched_getaffinity(0)) < 2:
        return "fewer than 2 cores"
    return None


def _spinner(core):
    """A process that keeps ``core`` busy until killed."""
    code = f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True:\n    pass\n"
    return subprocess.Popen([sys.executable, "-c", code])


def _run(rank, world_size, strategy):
    import deepspeed
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})
    spinners = [_spinner(cores[0]) for _ in range(2)] if rank == 0 else []
    try:
        heterogeneous = {"enabled": True, "emulation": {"speeds": [1.0, 0.5], "mode": "cgroup"}}
        if strategy == "uniform":
            heterogeneous.update(load_balancing_strategy="manual", micro_batch_sizes=[8, 8])
        else:
            heterogeneous.update(load_balancing_strategy="compute_aware", profile_steps=PROFILE,
                                 scheduler={"check_interval": CHECK_INTERVAL})
        config = {"train_batch_size": BATCH, "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
                  "heterogeneous_config": heterogeneous}
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(WIDTH, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, WIDTH))
        data = torch.utils.data.TensorDataset(torch.randn(BATCH * STEPS, WIDTH), torch.randn(BATCH * STEPS, WIDTH))
        engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                                    training_data=data)
        walls, plans = [], []
        batches = iter(loader)
        for _ in range(STEPS):
            began = time.perf_counter()
            x, y = next(batches)
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            engine.step()
            walls.append(time.perf_counter() - began)
            plans.append(list(engine.heterogeneous_plan.micro_batch_sizes))
        return {"walls": walls, "plans": plans}
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


@pytest.mark.multiprocess
def test_a_busy_neighbour_of_the_fast_rank_never_makes_the_plan_worse_than_uniform():
    reason = _cpu_cgroups_unusable()
    if reason:
        pytest.skip(f"CPU-quota emulation unusable here: {reason}")
    cases = [dict(strategy="uniform"), dict(strategy="compute_aware")]
    (uniform, _), (fork, other) = run_subcases(_run, cases, world_size=2, timeout=600)
    assert fork["plans"] == other["plans"]
    final = fork["plans"][-1]
    # The last steps ran the plan that stays (the switch after profiling was judged by then).
    assert len({tuple(plan) for plan in fork["plans"][-LAST:]}) == 1, fork["plans"]
    step = lambda walls: statistics.median(walls[-LAST:])  # noqa: E731 -- the steps at the final plan
    uniform_s, fork_s = step(uniform["walls"]), step(fork["walls"])
    assert fork_s <= uniform_s * (1 + TOLERANCE), (
        f"plan {final} took {fork_s:.4f} s per step against uniform's {uniform_s:.4f} s; plans {fork['plans']}")
