# SPDX-License-Identifier: Apache-2.0
"""Heterogeneity-aware ZeRO-3 settings: the fork partitions every parameter (persistence threshold
0) so that a ZeRO-3 step issues a few coalesced all-gathers instead of one per small parameter,
never over a value the user set, the same on every rank, and training stays exact."""

import pytest
import torch

from harness import run_subcases
from references import adam_mse_reference

from deepspeed.runtime.heterogeneous.memory.zero3_settings import (FORK_PERSISTENCE_THRESHOLD, PERSISTENCE_KEY,
                                                                   UPSTREAM_DEFAULTS, apply_zero3_settings,
                                                                   describe_zero3_settings, zero3_settings)

# -- the pure part --------------------------------------------------------------------------------


def test_stage_3_gets_threshold_0_and_other_stages_nothing():
    chosen = zero3_settings({"stage": 3})
    assert list(chosen) == [PERSISTENCE_KEY]
    assert chosen[PERSISTENCE_KEY].value == FORK_PERSISTENCE_THRESHOLD == 0
    assert chosen[PERSISTENCE_KEY].upstream == UPSTREAM_DEFAULTS[PERSISTENCE_KEY] == 100_000
    assert zero3_settings({"stage": "3"}) == chosen  # upstream's model accepts the stage as a string
    for zero in ({"stage": 0}, {"stage": 1}, {"stage": 2}, {}, {"stage": "x"}, None, True):
        assert zero3_settings(zero) == {}, zero


def test_a_value_the_user_sets_under_either_name_wins():
    assert zero3_settings({"stage": 3, "stage3_param_persistence_threshold": 5}) == {}
    assert zero3_settings({"stage": 3, "param_persistence_threshold": 5}) == {}
    # A budget for persistent parameters means the user wants persistence.
    assert zero3_settings({"stage": 3, "stage3_model_persistence_threshold": 10**6}) == {}


def test_parameter_offload_keeps_upstreams_persistence():
    for offload in ({"offload_param": {"device": "cpu"}}, {"offload_param": {"device": "nvme"}},
                    {"cpu_offload_param": True}):
        assert zero3_settings({"stage": 3, **offload}) == {}, offload
    for kept in ({"offload_param": {"device": "none"}}, {"offload_param": None},
                 {"offload_optimizer": {"device": "cpu"}}):
        assert list(zero3_settings({"stage": 3, **kept})) == [PERSISTENCE_KEY], kept
    param_dict = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    assert apply_zero3_settings(param_dict, frozenset({"stage", "offload_param"})) == {}
    assert PERSISTENCE_KEY not in param_dict["zero_optimization"]
    # The user's keys, taken before the fork wrote its own (adaptive chunking's sizes) into the block.
    param_dict = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 7,
                                        "stage3_prefetch_bucket_size": 1 << 20}}
    assert apply_zero3_settings(param_dict, frozenset({"stage", "stage3_param_persistence_threshold"})) == {}
    assert param_dict["zero_optimization"]["stage3_param_persistence_threshold"] == 7


def test_apply_writes_a_copy_and_keeps_the_forks_other_sizes():
    user = {"zero_optimization": {"stage": 3}}
    param_dict = dict(user)
    param_dict["zero_optimization"] = {"stage": 3, "stage3_prefetch_bucket_size": 1 << 20}  # chunking wrote it
    chosen = apply_zero3_settings(param_dict, frozenset({"stage"}))
    assert list(chosen) == [PERSISTENCE_KEY]
    assert param_dict["zero_optimization"] == {"stage": 3, "stage3_prefetch_bucket_size": 1 << 20,
                                               PERSISTENCE_KEY: 0}
    assert user == {"zero_optimization": {"stage": 3}}, "the user's dict must not change"
    # No block, or the legacy boolean form: nothing to write into.
    assert apply_zero3_settings({}) == {} and apply_zero3_settings({"zero_optimization": True}, None) == {}


def test_the_printed_block_names_each_key_its_value_and_upstreams():
    text = describe_zero3_settings(zero3_settings({"stage": 3}))
    assert text.startswith("[deepspeed-hetero] ZeRO-3 settings")
    assert "stage3_param_persistence_threshold 0 (upstream 100000)" in text and "override" in text
    assert describe_zero3_settings({}) is None


# -- two ranks --------------------------------------------------------------------------------------

SIZES = [10, 6]
STEPS = 3


def make_model():
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16),
                               torch.nn.LayerNorm(16), torch.nn.Linear(16, 16))


def batches():
    generator = torch.Generator().manual_seed(11)
    return [(torch.randn(16, 16, generator=generator), torch.randn(16, 16, generator=generator))
            for _ in range(STEPS)]


def zero3_run(rank, world_size, fork, zero_extra):
    import deepspeed
    from deepspeed.runtime.heterogeneous.measure.collective_log import recording
    config = {"train_batch_size": 16, "gradient_clipping": 0.0,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.0, "torch_adam": True}},
              "zero_optimization": {"stage": 3, **zero_extra},
              "heterogeneous_config": {"enabled": fork, "load_balancing_strategy": "manual",
                                       "micro_batch_sizes": SIZES}}
    if not fork:
        config["train_micro_batch_size_per_gpu"] = 8
    model = make_model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    sizes = SIZES if fork else [8, 8]
    offset, size = sum(sizes[:rank]), sizes[rank]
    per_step = []
    for inputs, targets in batches():
        with recording() as entries:
            loss = torch.nn.functional.mse_loss(engine(inputs[offset:offset + size]), targets[offset:offset + size])
            engine.backward(loss)
            engine.step()
        per_step.append([str(entry) for entry in entries])
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        params = [p.detach().clone() for p in engine.module.parameters()]
    return {"threshold": engine.zero_param_persistence_threshold(), "collectives": per_step, "params": params,
            "persistent": len(engine.optimizer.persistent_parameters)}


@pytest.mark.multiprocess
def test_two_ranks_gather_once_per_step_agree_and_train_exactly():
    cases = [dict(fork=True, zero_extra={}),
             dict(fork=True, zero_extra={"stage3_param_persistence_threshold": 100_000}),
             dict(fork=False, zero_extra={})]
    results = run_subcases(zero3_run, cases, world_size=2, timeout=300)
    inputs = torch.cat([b[0] for b in batches()])
    targets = torch.cat([b[1] for b in batches()])
    steps = [list(range(16 * k, 16 * k + 16)) for k in range(STEPS)]
    reference = adam_mse_reference(make_model(), inputs, targets, steps, 1e-2)
    gathers = []  # all-gathers in the last step (the prefetcher has traced the model by then)
    for case, ranks in zip(cases, results):
        assert ranks[0]["collectives"] == ranks[1]["collectives"], case  # one sequence on every rank
        for rank in ranks:
            for got, want in zip(rank["params"], reference):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=lambda m: f"{case}: {m}")
        gathers.append(sum(entry.startswith("all_gather_into_tensor") for entry in ranks[0]["collectives"][-1]))
    fork, user, upstream = results
    assert fork[0]["threshold"] == 0 and fork[0]["persistent"] == 0
    assert user[0]["threshold"] == 100_000 and user[0]["persistent"] == 8, "the user's value wins"
    assert upstream[0]["threshold"] == 100_000
    # Upstream re-gathers each of the 8 small parameters after every step, one all-gather each.
    assert gathers[1] == gathers[2] >= 8
    assert gathers[0] <= 2, f"the fork's setting should coalesce the gathers, got {gathers[0]} per step"
