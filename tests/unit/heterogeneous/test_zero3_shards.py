# SPDX-License-Identifier: Apache-2.0
"""Memory-proportional ZeRO-3 shards (``heterogeneous_memory.zero_partitions`` in stage 3).

Pure: the slices of one parameter (aligned, non-empty, covering it exactly; small parameters keep
upstream's equal slices) and the choice between a padded all-gather and one broadcast per owner.
Processes: ZeRO-3 with uneven shares equals single-process training (test_exactness's reference),
each rank holds its share of every parameter, gathered full fp32 parameters are the trained ones,
and a checkpoint resumes on its own shares, is refused on others and merges with zero_to_fp32.
"""

import pytest
import torch

from deepspeed.runtime.heterogeneous.comm.uneven_shards import choose_mode
from deepspeed.runtime.heterogeneous.memory.zero3_shards import (ALIGNMENT, ShardLayout, ShardLayoutError,
                                                                 check_checkpoint_shares, shard_layout)


@pytest.mark.parametrize("shares", [(0.75, 0.25), (0.25, 0.75), (0.97, 0.03), (0.5, 0.3, 0.15, 0.05)])
@pytest.mark.parametrize("numel", [ALIGNMENT * 4, 1000, 4099, 1536 * 1536 + 7])
def test_slices_are_aligned_non_empty_and_cover_the_parameter(shares, numel):
    spans = ShardLayout(shares).spans(numel)
    assert spans[0][0] == 0 and sum(size for _, size in spans) == numel
    for (start, size), (next_start, _) in zip(spans, spans[1:]):
        assert start + size == next_start and next_start % ALIGNMENT == 0
    assert all(size > 0 for _, size in spans)
    for share, (_, size) in zip(shares, spans):
        assert abs(size - share * numel) <= ALIGNMENT * len(shares), (shares, numel, spans)


def test_small_parameters_keep_equal_slices_and_even_shares_need_no_layout():
    layout = ShardLayout((0.75, 0.25))
    assert layout.spans(2 * ALIGNMENT - 1) is None and layout.spans(2 * ALIGNMENT) is not None
    assert shard_layout((0.5, 0.5), 2) is None and shard_layout(None, 2) is None
    with pytest.raises(ShardLayoutError, match="3 shares"):
        shard_layout((0.5, 0.25, 0.25), 2)


def test_the_gather_pads_while_a_ring_moves_no_more_than_broadcasts_would():
    assert choose_mode([750, 250], 2) == "pad"  # two ranks: always
    assert choose_mode([300, 300, 400], 3) == "pad"  # 2 * 400 <= 1000
    assert choose_mode([700, 100, 100, 100], 4) == "owners"  # 3 * 700 > 1000


def test_a_checkpoint_of_other_shares_is_refused_with_the_ways_out():
    check_checkpoint_shares({"heterogeneous_zero3_shares": [0.75, 0.25]}, (0.75, 0.25))
    check_checkpoint_shares({}, None)
    with pytest.raises(ShardLayoutError, match=r"saved with partition shares \[0.750, 0.250\].*equal shares.*universal"):
        check_checkpoint_shares({"heterogeneous_zero3_shares": [0.75, 0.25]}, None)
    with pytest.raises(ShardLayoutError, match=r"equal shares but this run partitions with \[0.250, 0.750\]"):
        check_checkpoint_shares({}, (0.25, 0.75))


# -- training ---------------------------------------------------------------------------------------


def _train_zero3(rank, world_size, gas, sizes, clipping, shares, zero=None, bf16=False, init=False):
    """test_exactness's training in ZeRO-3 with ``zero_partitions: shares``; returns the parameters
    (gathered), their full fp32 master copies, and each parameter's local slice numel."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param
    from test_exactness import BF16_LR, ds_config, make_model, train_slices

    config = ds_config(3, gas, sizes, clipping)
    config["heterogeneous_memory"] = {"zero_partitions": shares}
    config["zero_optimization"].update(zero or {})
    if bf16:
        config.update(bf16={"enabled": True}, optimizer={"type": "SGD", "params": {"lr": BF16_LR}},
                      zero_allow_untested_optimizer=True)
    if init:  # built partitioned, as large models are: the shares must be known before the model
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = make_model()
    else:
        model = make_model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    local = [int(p.ds_tensor.numel()) for p in engine.module.parameters()]
    train_slices(engine, rank, sizes, gas, config["train_batch_size"], torch.bfloat16 if bf16 else None)
    full_fp32 = [safe_get_full_fp32_param(p).clone() for p in engine.module.parameters()]
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        params = [p.detach().float().clone() for p in engine.module.parameters()]
    return {"params": params, "full_fp32": full_fp32, "local": local}


def _expect_shares(shares, per_rank):
    """The 16x32 and 32x16 weights (512 elements) are cut by share; the biases (16, 32) keep
    upstream's equal slices."""
    for share, result in zip(shares, per_rank):
        weights = [result["local"][0], result["local"][2]]
        assert all(abs(n - share * 512) <= ALIGNMENT for n in weights), (shares, [r["local"] for r in per_rank])


ZERO3_CASES = [
    dict(gas=1, sizes=[5, 3], clipping=0.0, shares=[0.75, 0.25]),
    dict(gas=2, sizes=[7, 1], clipping=0.05, shares=[0.25, 0.75]),
    dict(gas=1, sizes=[5, 3], clipping=0.0, shares=[0.8, 0.2], init=True),
    dict(gas=2, sizes=[5, 3], clipping=1.0, shares=[0.75, 0.25],
         zero={"reduce_scatter": False, "stage3_param_persistence_threshold": 0}),
]


@pytest.mark.multiprocess
def test_uneven_zero3_shards_train_exactly_and_each_rank_holds_its_share():
    from harness import run_subcases
    from test_exactness import reference_parameters

    results = run_subcases(_train_zero3, ZERO3_CASES, world_size=2, timeout=600)
    for case, per_rank in zip(ZERO3_CASES, results):
        _expect_shares(case["shares"], per_rank)
        expected = reference_parameters(sum(case["sizes"]) * case["gas"], case["clipping"])
        for result in per_rank:
            for got, full, want in zip(result["params"], result["full_fp32"], expected):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=lambda m: f"{case}: {m}")
                torch.testing.assert_close(full, got, rtol=0, atol=0, msg=lambda m: f"{case}: {m}")


@pytest.mark.multiprocess
def test_four_ranks_gather_per_owner_and_bf16_tracks_the_reference():
    """Shares (0.5, 0.3, 0.15, 0.05) on 4 ranks: one broadcast per owner moves fewer bytes than a
    padded ring (3 x 0.5 > 1), so the other collectives run; bf16 with SGD as test_exactness's."""
    from harness import run_subcases
    from test_exactness import BF16_LR, reference_parameters, sgd_reference

    four = dict(gas=1, sizes=[3, 3, 1, 1], clipping=0.05, shares=[0.5, 0.3, 0.15, 0.05])
    per_rank, = run_subcases(_train_zero3, [four], world_size=4, timeout=600)
    _expect_shares(four["shares"], per_rank)
    for result in per_rank:
        for got, want in zip(result["params"], reference_parameters(8, 0.05)):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    bf16 = dict(gas=1, sizes=[5, 3], clipping=0.0, shares=[0.75, 0.25], bf16=True)
    per_rank, = run_subcases(_train_zero3, [bf16], world_size=2, timeout=600)
    _expect_shares(bf16["shares"], per_rank)
    for result in per_rank:
        for got, want in zip(result["params"], sgd_reference(8, BF16_LR)):
            torch.testing.assert_close(got, want, rtol=0, atol=2.5e-3)


def _engine_and_cut(rank, world_size, init):
    """``zero_partitions: [0.75, 0.25]`` for the engine: its shares and the optimizer's, for a model
    built normally, or cut into equal slices by ``zero.Init`` (given ``"even"``) before the engine."""
    import copy
    import deepspeed
    from test_exactness import ds_config, make_model, train_slices

    config = ds_config(3, 1, [5, 3], 0.0)
    config["heterogeneous_memory"] = {"zero_partitions": [0.75, 0.25]}
    if init:
        even = copy.deepcopy(config)
        even["heterogeneous_memory"]["zero_partitions"] = "even"
        with deepspeed.zero.Init(config_dict_or_path=even):
            model = make_model()
    else:
        model = make_model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    train_slices(engine, rank, [5, 3], 1, 8)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        params = [p.detach().clone() for p in engine.module.parameters()]
    return {"engine": engine._config.heterogeneous.partition_shares, "optimizer": engine.optimizer.zero3_shares,
            "params": params}


@pytest.mark.multiprocess
def test_a_model_cut_by_zero_init_before_the_engine_keeps_its_cut():
    """The engine's placement and its log follow the slices the parameters have, not the config's."""
    from harness import run_subcases
    from test_exactness import reference_parameters

    built, cut = run_subcases(_engine_and_cut, [dict(init=False), dict(init=True)], world_size=2, timeout=600)
    assert built[0]["engine"] == built[0]["optimizer"] == (0.75, 0.25), (built[0]["engine"], built[0]["optimizer"])
    assert cut[0]["engine"] is None and cut[0]["optimizer"] is None, (cut[0]["engine"], cut[0]["optimizer"])
    for result in built + cut:
        for got, want in zip(result["params"], reference_parameters(8, 0.0)):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


GPT_LR, GPT_STEPS = 0.5, 4  # SGD: every gradient's value shows in the update (Adam's hides its scale)


def _gpt_batches(gas):
    """``GPT_STEPS`` global batches of 8 token rows (inputs and targets) per micro-step."""
    from examples.tiny_gpt.data import VOCAB_SIZE
    generator = torch.Generator().manual_seed(3)
    return [[torch.randint(0, VOCAB_SIZE, (8, 33), generator=generator) for _ in range(gas)] for _ in range(GPT_STEPS)]


def _gpt_model():
    from examples.tiny_gpt import GPT, GPTConfig
    return GPT(GPTConfig(seq_len=32, n_layer=2, n_head=2, d_model=64), seed=5)


def _train_gpt(rank, world_size, shares, gas, clipping, sizes=(5, 3)):
    """The project's small GPT (its head tied to the token embedding) in ZeRO-3 with ``shares``."""
    import deepspeed
    model = _gpt_model()
    config = {"train_batch_size": 8 * gas, "gradient_accumulation_steps": gas, "gradient_clipping": clipping,
              "optimizer": {"type": "SGD", "params": {"lr": GPT_LR}}, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 3, "reduce_bucket_size": 20_000},
              "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "manual",
                                       "micro_batch_sizes": list(sizes)},
              "heterogeneous_memory": {"zero_partitions": shares}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    start = sum(sizes[:rank])
    for micro_batches in _gpt_batches(gas):
        for rows in micro_batches:
            mine = rows[start:start + sizes[rank]]
            engine.backward(engine(mine[:, :-1], mine[:, 1:]))
            engine.step()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return [p.detach().clone() for p in engine.module.parameters()]


def _gpt_reference(gas, clipping):
    model = _gpt_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=GPT_LR)
    for micro_batches in _gpt_batches(gas):
        optimizer.zero_grad()
        for rows in micro_batches:
            (model(rows[:, :-1], rows[:, 1:]) / gas).backward()
        if clipping:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clipping)
        optimizer.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.multiprocess
def test_a_small_gpt_with_a_tied_head_trains_on_uneven_shards_as_on_even_ones():
    """Uneven shards change where each slice lives, not what is computed: the GPT's parameters
    equal the even-share run's and single-process training (SGD moves them by up to 7e-2; measured
    difference 6e-8)."""
    from harness import run_subcases
    cases = [dict(shares="even", gas=1, clipping=0.0), dict(shares=[0.7, 0.3], gas=1, clipping=0.0),
             dict(shares="even", gas=2, clipping=0.5), dict(shares=[0.3, 0.7], gas=2, clipping=0.5)]
    results = run_subcases(_train_gpt, cases, world_size=2, timeout=600)
    for index in (1, 3):
        case, even = cases[index], results[index - 1][0]
        expected = _gpt_reference(case["gas"], case["clipping"])
        for params in results[index]:
            for got, same, want in zip(params, even, expected):
                torch.testing.assert_close(got, same, rtol=0, atol=1e-6, msg=lambda m: f"{case} vs even: {m}")
                torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=lambda m: f"{case}: {m}")


# -- checkpoints of uneven shards -------------------------------------------------------------------

def _checkpoint_run(rank, world_size, **case):
    """test_zero_partitions's checkpoint run (save after step 3, or resume from it) in ZeRO-3."""
    from test_zero_partitions import _checkpoint_run as run
    return run(rank, world_size, stage=3, **case)


@pytest.mark.multiprocess
def test_uneven_zero3_checkpoints_resume_exactly_merge_and_refuse_other_shares(tmp_path):
    """Saved with shares (0.75, 0.25): resumed on them = the uninterrupted run; a per-rank load with
    equal shares is refused by name (re-partitioning off) or re-partitioned by the fork (on);
    zero_to_fp32 merges the uneven slices; the universal checkpoint converted by hand re-partitions
    onto equal and reversed shares and onto one rank, exactly."""
    import subprocess
    import sys

    from harness import run_subcases
    from test_exactness import reference_parameters
    from test_zero_partitions import SAVE_AT, _reference_after

    folder = str(tmp_path)
    cases = [dict(shares=[0.75, 0.25], folder=folder, save=True),
             dict(shares=[0.75, 0.25], folder=folder, load="saved"),
             dict(shares="even", folder=folder, load="saved"),
             dict(shares="even", folder=folder, load="saved", repartition=True)]
    results = run_subcases(_checkpoint_run, cases, world_size=2, timeout=600)
    uninterrupted = results[0][0]["full_fp32"]
    for got, want in zip(uninterrupted, reference_parameters(8, 0.0)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    for rank_result in results[1] + results[3]:  # the same shares; other shares re-partitioned by the fork
        for got, want in zip(rank_result["full_fp32"], uninterrupted):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    for rank_result in results[2]:
        assert "saved with partition shares [0.750, 0.250]" in rank_result.get("error", ""), rank_result

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    merged = get_fp32_state_dict_from_zero_checkpoint(folder, tag="saved")
    for got, want in zip(merged.values(), _reference_after(SAVE_AT)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)

    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", f"{folder}/saved",
                    "--output_folder", f"{folder}/saved_universal", "--num_extract_workers", "1",
                    "--num_merge_workers", "1", "--inject_missing_state"], check=True, capture_output=True, cwd=folder)
    universal = [dict(shares="even", folder=folder, load="saved", universal=True),
                 dict(shares=[0.25, 0.75], folder=folder, load="saved", universal=True)]
    for case, per_rank in zip(universal, run_subcases(_checkpoint_run, universal, world_size=2, timeout=600)):
        for rank_result in per_rank:
            assert "full_fp32" in rank_result, (case, rank_result)
            for got, want in zip(rank_result["full_fp32"], uninterrupted):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=lambda m: f"{case}: {m}")
    (alone, ), = run_subcases(_checkpoint_run, [dict(shares="even", folder=folder, load="saved", universal=True,
                                                     sizes=[8])], world_size=1, timeout=600)
    assert "full_fp32" in alone, alone
    for got, want in zip(alone["full_fp32"], uninterrupted):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
