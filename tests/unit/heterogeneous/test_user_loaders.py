# SPDX-License-Identifier: Apache-2.0
"""Users' own loaders: the engine checks every batch fed against the plan, and a loader built on
``engine.heterogeneous_sampler`` follows plan changes and trains exactly.

Two ranks, compute_aware with rank 1 emulated at a quarter of the speed. Profiling may change the
plan during its steps (or keep it, within the measured noise); a re-plan on demand from given
busy times then changes it for certain ([8, 8] -> [12, 4]). A loader that does not follow the
plan is caught at the first forward after a change, and one that follows it must see every
change and train exactly.
"""

import pytest
import torch

from harness import run_subcases
from references import adam_mse_reference

WIDTH = 32
DATASET = 96
BATCH = 16
LR = 1e-3


def make_model():
    torch.manual_seed(11)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, 128), torch.nn.Tanh(), torch.nn.Linear(128, WIDTH))


def dataset():
    generator = torch.Generator().manual_seed(4)
    inputs = torch.randn(DATASET, WIDTH, generator=generator)
    targets = torch.randn(DATASET, WIDTH, generator=generator)
    return torch.utils.data.TensorDataset(torch.arange(DATASET), inputs, targets)


def config(stage=1, profile_steps=3):
    return {"train_batch_size": BATCH, "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "Adam", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
            "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "compute_aware",
                                     "profile_steps": profile_steps,
                                     # the on-demand re-plan below must switch whatever profiling chose
                                     "scheduler": {"imbalance_threshold": 0.01},
                                     "emulation": {"speeds": [1.0, 0.25], "mode": "dilation"}}}


def _engine(profile_steps=3, **heterogeneous):
    import deepspeed
    model = make_model()
    ds_config = config(profile_steps=profile_steps)
    ds_config["heterogeneous_config"].update(heterogeneous)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    return engine


RESCHEDULE_AT = 4  # after profiling: every rank re-plans on demand from busy times in which
PER_SAMPLE = [1.0, 3.0]  # rank 1 is three times as slow per sample, whatever the plan: [12, 4]


def int32_indices(items):
    """A user's collate_fn (in worker processes it must be picklable): the indices as int32, which
    the default collate never produces, so the test sees which one built the batch."""
    index, inputs, targets = torch.utils.data.default_collate(items)
    return index.to(torch.int32), inputs, targets


def _train(engine, loader, steps, index_dtype=torch.int64):
    seen, sizes = [], []
    batches = iter(loader)
    for step in range(steps):
        if step == RESCHEDULE_AT:
            sizes_now = engine.heterogeneous_plan.micro_batch_sizes
            engine.reschedule_workload([n * t for n, t in zip(sizes_now, PER_SAMPLE)])
        index, inputs, targets = next(batches)
        assert index.dtype == index_dtype, index.dtype
        engine.backward(torch.nn.functional.mse_loss(engine(inputs), targets))
        engine.step()
        seen.append(index.tolist())
        sizes.append(len(index))
    return seen, sizes


def distributed_sampler_loader(rank, world_size):
    """The usual DeepSpeed recipe (equal batches from a DistributedSampler) with re-splitting off
    (``resplit_fed_batches: false``): refused at the first forward after the plan changed, on every
    rank, with a message that says how to fix it. (With the default, ``auto``, the engine re-splits
    such batches: test_resplit.py.)"""
    from deepspeed.runtime.heterogeneous.data.fed_batch import FedBatchMismatchError
    # The plan changes only on demand, at step RESCHEDULE_AT.
    engine = _engine(profile_steps=0, resplit_fed_batches=False)
    data = dataset()
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=world_size, rank=rank, seed=0)
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH // world_size, sampler=sampler)
    try:
        _train(engine, loader, RESCHEDULE_AT + 2)
    except FedBatchMismatchError as exc:
        return {"error": str(exc), "steps": engine.global_steps, "plan": list(engine.heterogeneous_plan.micro_batch_sizes)}
    return {"error": None, "steps": engine.global_steps}


def own_loader(rank, world_size, workers):
    """A user-built DataLoader on engine.heterogeneous_sampler (workers=None), or the engine's own
    loader through deepspeed_io with worker processes and a collate_fn of the user's."""
    from deepspeed.runtime.heterogeneous.data.sampler import HeterogeneousDistributedSampler
    engine = _engine()
    data = dataset()
    if workers is None:
        loader = torch.utils.data.DataLoader(data, batch_sampler=engine.heterogeneous_sampler(data, seed=0))
    else:
        loader = engine.deepspeed_io(data, collate_fn=int32_indices, num_local_io_workers=workers)
        assert loader.num_workers == workers
    seen, sizes = _train(engine, loader, DATASET // BATCH, torch.int64 if workers is None else torch.int32)
    errors = []
    # Evaluation forwards (no autograd) are not training micro-steps: any size goes.
    with torch.no_grad():
        engine(data.tensors[1][:3])
    # Only a batch sampler of this rank can follow the plan.
    for bad in (HeterogeneousDistributedSampler(data, [8, 8], rank=rank),
                engine.heterogeneous_sampler(data).__class__(data, [8, 8], rank=1 - rank)):
        try:
            engine.register_heterogeneous_sampler(bad)
        except (TypeError, ValueError) as exc:
            errors.append(str(exc))
    with torch.no_grad():
        params = [p.detach().clone() for p in engine.module.parameters()]
    return {"seen": seen, "sizes": sizes, "params": params, "errors": errors,
            "plan": list(engine.heterogeneous_plan.micro_batch_sizes)}


def one_rank_fed_otherwise(rank, world_size, fault):
    """ZeRO-2 (a gradient collective every micro-step), manual [12, 4]. ``wrong_size``: with
    re-splitting off, rank 1 alone is fed 5 samples at its second step. ``sampler_on_one_rank``:
    rank 0 alone registers a heterogeneous sampler (so it would not re-split, while rank 1 would).
    Each rank reports the error it raised; before the ranks agreed on these facts at every
    forward, the rank that noticed stopped alone and its peer waited in the next collective."""
    import deepspeed
    from deepspeed.runtime.heterogeneous.data.fed_batch import FedBatchMismatchError, FeedingError
    from deepspeed.runtime.heterogeneous.data.sampler import HeterogeneousBatchSampler
    model = make_model()
    ds_config = config(stage=2, profile_steps=0)
    ds_config["heterogeneous_config"].update(load_balancing_strategy="manual", micro_batch_sizes=[12, 4],
                                             emulation=None)
    if fault == "wrong_size":
        ds_config["heterogeneous_config"]["resplit_fed_batches"] = False
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    if fault == "sampler_on_one_rank" and rank == 0:
        engine.register_heterogeneous_sampler(HeterogeneousBatchSampler(dataset(), [12, 4], rank=rank))
    try:
        for step in range(3):
            rows = [12, 4][rank] + (1 if fault == "wrong_size" and rank == 1 and step == 1 else 0)
            inputs = torch.randn(rows, WIDTH)
            engine.backward(torch.nn.functional.mse_loss(engine(inputs), inputs))
            engine.step()
    except (FedBatchMismatchError, FeedingError) as exc:
        return {"error": str(exc), "steps": engine.global_steps,
                "every_rank": getattr(exc, "deepspeed_hetero_every_rank", False)}
    return {"error": None, "steps": engine.global_steps}


@pytest.mark.multiprocess
def test_a_rank_fed_otherwise_stops_every_rank_with_one_message():
    cases = [{"fault": "wrong_size"}, {"fault": "sampler_on_one_rank"}]
    wrong_size, one_sampler = run_subcases(one_rank_fed_otherwise, cases, world_size=2, timeout=240)
    assert [r["steps"] for r in wrong_size] == [1, 1], wrong_size
    assert wrong_size[0]["error"] == wrong_size[1]["error"], "every rank raises the same message"
    assert "data-parallel rank 1 was fed a micro-batch of 5 samples, but the plan in force gives it 4" in \
        wrong_size[0]["error"], wrong_size[0]["error"]
    assert [r["steps"] for r in one_sampler] == [0, 0], one_sampler
    assert one_sampler[0]["error"] == one_sampler[1]["error"], "every rank raises the same message"
    assert "rank(s) [0] are fed by the engine's loader or a registered heterogeneous sampler and rank(s) [1] are not" \
        in one_sampler[0]["error"], one_sampler[0]["error"]
    assert all(r["every_rank"] for r in wrong_size + one_sampler), "printed once, by rank 0"


@pytest.mark.multiprocess
def test_equal_batches_are_refused_once_the_plan_changes_with_resplitting_off():
    results = run_subcases(distributed_sampler_loader, [{}], world_size=2, timeout=300)[0]
    for rank, result in enumerate(results):
        error = result["error"]
        assert error is not None, f"rank {rank} trained {result['steps']} steps on equal batches without an error"
        assert result["steps"] == RESCHEDULE_AT, "the plan change must be caught at the next forward"
        assert result["plan"] == [12, 4], result["plan"]
        planned = result["plan"][rank]
        assert f"data-parallel rank {rank} was fed a micro-batch of {BATCH // 2} samples" in error, error
        assert f"gives it {planned}" in error and "engine.heterogeneous_sampler(dataset)" in error, error


@pytest.mark.multiprocess
@pytest.mark.parametrize("workers", [None, 2], ids=["user-dataloader", "engine-loader-with-workers"])
def test_own_loader_follows_plan_changes_and_stays_exact(workers):
    fast, slow = run_subcases(own_loader, [dict(workers=workers)], world_size=2, timeout=300)[0]
    assert fast["sizes"][0] == slow["sizes"][0] == BATCH // 2, "start-up plan is even (no datasheet score for CPUs)"
    assert fast["plan"] == [12, 4], fast["plan"]
    assert fast["sizes"][RESCHEDULE_AT:] == [12, 12] and slow["sizes"][RESCHEDULE_AT:] == [4, 4]
    step_indices = [a + b for a, b in zip(fast["seen"], slow["seen"])]
    assert sorted(i for step in step_indices for i in step) == list(range(DATASET))
    _, inputs, targets = dataset().tensors
    for got, want in zip(fast["params"], adam_mse_reference(make_model(), inputs, targets, step_indices, LR)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert len(fast["errors"]) == 2, fast["errors"]
    assert "takes a HeterogeneousBatchSampler" in fast["errors"][0]
    assert "the sampler is for rank 1 of 2 data-parallel ranks, this engine is rank 0" in fast["errors"][1]
