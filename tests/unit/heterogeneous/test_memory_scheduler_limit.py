# SPDX-License-Identifier: Apache-2.0
"""A rank under a memory limit set from outside trains at the default threshold (0.85) and equals
single-process training, where upstream's even shares need more than the limit allows.

Two ranks, a model no other test uses and whose activations outweigh its state, as in long-sequence
training: eight MLP blocks (LayerNorm(64), Linear(64, 1024), GELU, Linear(1024, 64)) over 64 tokens
per sample, 1.1M parameters, Adam, fp32, global batch 224 (about 4.3 MiB of activations per
sample). Rank 1 joins a memory cgroup just before ``deepspeed.initialize``, as a job scheduler's
limit would hold it; the cgroup's name is not the fork's, so the fork reads it as an outside limit
(its capacity) and does not know it is a test.

- Calibration: upstream (the fork off, even shares) with rank 1 in a cgroup that only measures:
  its peak for the stage.
- The fork, ``heterogeneous_memory: {enabled: true}`` at the default threshold, compute-aware:
  rank 1's limit is 85% and then 60% of that peak. Before anything was measured, the first step
  gives rank 1 its room's proportion of the batch (``memory/model_state.startup_memory_limits``); that step
  measures its activations, and the plan after it gives rank 1 what its predicted peak
  (``memory/peak.py``) allows within 85% of the limit. It trains in ZeRO-1, 2 and 3, its measured
  peak stays under the limit, and the parameters equal single-process training.

Needs root and the memory controller; skips with the reason elsewhere, never in CI.
"""

import os
from pathlib import Path

import pytest
import torch

from harness import run_ranks

WIDTH, HIDDEN, BLOCKS, TOKENS, STEPS, LR = 64, 1024, 8, 64, 4, 1e-3
GLOBAL_BATCH = 224
METER_BYTES = 64 * 2**30
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
PREFIX = "hetero-test-scheduler-limit-"


def make_model():
    torch.manual_seed(0)
    blocks = []
    for _ in range(BLOCKS):
        blocks += [torch.nn.LayerNorm(WIDTH), torch.nn.Linear(WIDTH, HIDDEN), torch.nn.GELU(),
                   torch.nn.Linear(HIDDEN, WIDTH)]
    return torch.nn.Sequential(*blocks)


def global_batch(step):
    return torch.randn(GLOBAL_BATCH, TOKENS, WIDTH, generator=torch.Generator().manual_seed(100 + step))


def reference():
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    for step in range(STEPS):
        optimizer.zero_grad()
        model(global_batch(step)).pow(2).mean().backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


def _config(fork, stage):
    config = {"train_batch_size": GLOBAL_BATCH, "gradient_clipping": 0, "steps_per_print": 10**6,
              "optimizer": {"type": "Adam", "params": {"lr": LR, "torch_adam": True}},
              "zero_optimization": {"stage": stage}}
    if not fork:
        config["train_micro_batch_size_per_gpu"] = GLOBAL_BATCH // 2
        return config
    config["heterogeneous_config"] = {"enabled": True, "load_balancing_strategy": "compute_aware",
                                      "profile_steps": 2}
    config["heterogeneous_memory"] = {"enabled": True}  # the default threshold, 0.85
    return config


def _train(rank, world_size, fork, stage, limit_bytes):
    import deepspeed
    cgroup = CGROUP_ROOT / f"{PREFIX}{os.getpid()}"
    model = make_model()
    if rank == 1:
        cgroup.mkdir()
        (cgroup / "memory.limit_in_bytes").write_text(str(limit_bytes or METER_BYTES))
        (cgroup / "cgroup.procs").write_text(str(os.getpid()))
    try:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=_config(fork, stage))
        for step in range(STEPS):
            sizes = list(engine.heterogeneous_plan.micro_batch_sizes) if fork else [GLOBAL_BATCH // 2] * 2
            start = sum(sizes[:rank])
            engine.backward(engine(global_batch(step)[start:start + sizes[rank]]).pow(2).mean())
            engine.step()
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
            result = {"params": [p.detach().clone() for p in engine.module.parameters()]}
        if rank == 1:
            result["peak"] = int((cgroup / "memory.max_usage_in_bytes").read_text())
        if fork:
            state = engine._config.heterogeneous
            placed = state.memory_pool.placement.ranks[state.dp_rank]
            result.update(sizes=list(engine.heterogeneous_plan.micro_batch_sizes), predicted=placed.predicted_peak_bytes,
                          budget=placed.budget_bytes, measured=placed.measured_peak_bytes,
                          report=str(state.memory_pool.report()))
        return result
    finally:
        if rank == 1:  # leave before the parameters travel to the parent: not the rank's memory
            (CGROUP_ROOT / "cgroup.procs").write_text(str(os.getpid()))
            cgroup.rmdir()


@pytest.fixture
def memory_cgroups():
    reason = ("not root" if os.geteuid() != 0 else
              "no cgroup v1 memory controller" if not (CGROUP_ROOT / "cgroup.procs").is_file() else None)
    if reason is not None:
        assert os.environ.get("CI") != "true", f"CI must run the physical memory tests: {reason}"
        pytest.skip(f"memory cgroups unusable here: {reason}")
    yield
    for stale in CGROUP_ROOT.glob(f"{PREFIX}*"):  # a killed rank's cgroup
        try:
            stale.rmdir()
        except OSError:
            pass


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_rank_under_an_outside_limit_trains_exactly_at_the_default_threshold(memory_cgroups, stage):
    _, upstream = run_ranks(_train, world_size=2, timeout=300, args=(False, stage, None))
    even_peak = upstream["peak"]
    want = reference()
    for fraction in (0.85, 0.60):
        limit = int(fraction * even_peak)
        where = f"ZeRO-{stage}, limit {fraction:.0%} of upstream's {even_peak / 2**20:.0f} MiB = {limit / 2**20:.0f} MiB"
        first, second = run_ranks(_train, world_size=2, timeout=300, args=(True, stage, limit))
        context = (f"{where}; rank 1 runs {second['sizes'][1]} of {GLOBAL_BATCH} samples, predicted "
                   f"{second['predicted'] / 2**20:.0f} MiB, measured {second['peak'] / 2**20:.0f} MiB\n{second['report']}")
        print(context)  # shown with -s (the numbers the benchmark report quotes)
        assert second["peak"] <= limit, context
        # The plan sizes rank 1 on the activations' linear fit; the report's prediction follows the
        # activations measured once that size ran, which can exceed the fit by a fraction of a
        # percent (measured: 0.19 MiB of 358). The physical limit is the assertion above.
        assert second["predicted"] <= 1.01 * second["budget"], context
        assert second["measured"] is not None and second["measured"] <= limit, context
        assert second["sizes"][1] < GLOBAL_BATCH // 2, context  # upstream's even share did not fit
        for got_rank in (first, second):
            for got, expected in zip(got_rank["params"], want):
                torch.testing.assert_close(got, expected, rtol=0, atol=2e-4, msg=lambda m: f"{context}\n{m}")
