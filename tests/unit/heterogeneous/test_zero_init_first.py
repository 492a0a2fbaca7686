# SPDX-License-Identifier: Apache-2.0
"""``deepspeed.zero.Init`` before any process group, as transformers enters it, and ``"auto"`` ZeRO-3
shares decided there and revisited by the engine.

Pure: ``zero.Init``'s prior (the ranks' memory budgets, by the engine's own rule for a model as
large as they hold together) and when a cut is worth redoing. Launched (the real deepspeed
launcher, tests/unit/scripts/zero_init_first.py): a model built under ``zero.Init`` as the script's
first statement, with per-rank lists in the config, sees the real world; with ``"auto"`` it ends on
the shares the engine gives the same model built without ``zero.Init`` (re-cut once, parameter by
parameter), as does a model cut evenly first; an explicit cut is kept where the engine is not
given ``"auto"``; an activation estimate makes ``"auto"`` leave rank 1 room for samples (a smaller
share); every case equals one process's SGD on the global batch.
"""

import os
from pathlib import Path

import pytest
import torch

from harness import launch_deepspeed
from deepspeed.runtime.heterogeneous.memory.partitions import choose_partition_shares, shares_differ

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "zero_init_first.py"


def test_a_cut_is_redone_only_when_a_share_moves_by_more_than_a_tenth_of_it():
    assert not shares_differ("even", None, 2)
    assert not shares_differ("even", (0.54, 0.46), 2)
    assert shares_differ("even", (0.56, 0.44), 2)
    assert shares_differ((0.9, 0.1), (0.88, 0.12), 2)  # rank 1's 0.1 moves by 20%
    assert not shares_differ((0.75, 0.25), (0.75, 0.25), 2)


def test_the_zero_init_prior_fills_each_rank_in_proportion_to_its_budget():
    # The engine's rule with the whole budget as the state: every rank capped at its part of it.
    budgets = [16e9, 4e9]
    assert choose_partition_shares([1.0, 1.0], budgets, sum(budgets)) == (0.8, 0.2)
    # A rank of unknown memory takes what the others' budgets leave by speed.
    assert choose_partition_shares([1.0, 1.0], [4e9, None], 4e9)[0] <= 0.5


def _load(tmp_path, case):
    return [torch.load(tmp_path / f"{case}-rank{rank}.pt") for rank in range(2)]


def _reference():
    from importlib.util import module_from_spec, spec_from_file_location
    spec = spec_from_file_location("zero_init_first", SCRIPT)
    script = module_from_spec(spec)
    spec.loader.exec_module(script)
    model = script.make_model()
    initial = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=script.LR)
    for rows in script.batches():
        optimizer.zero_grad()
        model(rows).pow(2).mean().backward()
        optimizer.step()
    return initial, [p.detach() for p in model.parameters()]


@pytest.mark.multiprocess
def test_zero_init_first_sees_the_world_and_auto_ends_on_the_engines_shares(tmp_path):
    code, output = launch_deepspeed(SCRIPT, ["--out", tmp_path], timeout=400)
    assert code == 0, output[-8000:]
    results = {case: _load(tmp_path, case) for case in ("init_auto", "plain_auto", "init_even", "init_list",
                                                         "plain_room")}
    engine_auto = results["plain_auto"][0]["shares"]
    assert engine_auto is not None and engine_auto[1] < 0.45, engine_auto  # memory binds on rank 1
    for case, per_rank in results.items():
        assert [r["world"] for r in per_rank] == [2, 2], case
        assert per_rank[0]["shares"] == per_rank[1]["shares"], case
    assert results["init_auto"][0]["shares"] == engine_auto
    assert results["init_even"][0]["shares"] == engine_auto
    assert results["init_list"][0]["shares"] == (0.75, 0.25)
    # Room for rank 1's 4 samples of 2 MiB each comes out of its share of the state.
    assert results["plain_room"][0]["shares"][1] < engine_auto[1] - 0.05, results["plain_room"][0]["shares"]
    assert "leave each rank room for" in output
    # The first cut was zero.Init's prior, not the engine's shares: the engine re-cut it, and each
    # rank's slices now follow its share (the 1024x1024 weights).
    for rank in range(2):
        auto = results["init_auto"][rank]
        assert auto["cut"] != auto["local"], auto["cut"]
        assert abs(auto["local"][0] - engine_auto[rank] * 1024 * 1024) <= 64, auto["local"]
        assert results["init_even"][rank]["cut"][0] == 1024 * 1024 // 2
    assert "re-cut the ZeRO-3 parameters" in output
    initial, expected = _reference()
    for case, per_rank in results.items():
        for result in per_rank:
            for got, want, start in zip(result["params"], expected, initial):
                # The update, so that a wrong gradient scale cannot pass (SGD shows it whole; an
                # unweighted split is off by 20-40%).
                error = (got - want).norm() / (want - start).norm()
                assert error < 1e-4, (case, float(error))  # fp32 rounding of the parameters: ~2e-5
