# SPDX-License-Identifier: Apache-2.0
"""adaptive_chunking: ZeRO's bucket and prefetch sizes from the smallest rank's memory, identical
on every rank, never above upstream's defaults, and never over a size the config sets itself."""

import pytest
import torch

from harness import run_subcases
from references import adam_mse_reference

from deepspeed.runtime.heterogeneous.memory.chunking import MIN_ELEMENTS, adaptive_chunk_sizes, apply_adaptive_chunking

GIB = 1 << 30


def aligned(elements):
    return int(elements) - int(elements) % 1024


def test_sizes_follow_the_smallest_capacity_and_stay_under_upstreams_defaults():
    sizes = adaptive_chunk_sizes([16 * GIB, 8 * GIB], {})
    assert sizes == {"reduce_bucket_size": aligned(8 * GIB * 0.02 // 4),
                     "allgather_bucket_size": aligned(8 * GIB * 0.02 // 4),
                     "stage3_prefetch_bucket_size": aligned(8 * GIB * 0.01 // 4),
                     "stage3_max_live_parameters": aligned(8 * GIB * 0.05 // 4)}
    # 2% of 1 GiB is 5,368,709 elements, which ZeRO-1/2 refuse as an allgather_bucket_size (not a
    # multiple of their alignment): every size is a multiple of 1024.
    assert all(size % 1024 == 0 for size in adaptive_chunk_sizes([GIB], {}).values())
    # An 80 GB device would get more than upstream gives: upstream's default is the ceiling.
    big = adaptive_chunk_sizes([640 * GIB, 640 * GIB], {})
    assert big["reduce_bucket_size"] == 500_000_000 and big["stage3_max_live_parameters"] == 1_000_000_000
    assert adaptive_chunk_sizes([GIB // 8], {})["stage3_prefetch_bucket_size"] == MIN_ELEMENTS


def test_a_size_the_config_sets_is_kept_and_unknown_capacities_change_nothing():
    sizes = adaptive_chunk_sizes([8 * GIB, None], {"reduce_bucket_size": 123, "prefetch_bucket_size": 7})
    assert "reduce_bucket_size" not in sizes and "stage3_prefetch_bucket_size" not in sizes
    assert sizes["allgather_bucket_size"] == aligned(8 * GIB * 0.02 // 4)
    assert adaptive_chunk_sizes([None, None], {}) == {} and adaptive_chunk_sizes(None, {}) == {}
    user = {"zero_optimization": {"stage": 2}}
    param_dict = dict(user)
    apply_adaptive_chunking(param_dict, [8 * GIB])
    assert user == {"zero_optimization": {"stage": 2}}, "the user's dict must not change"
    assert param_dict["zero_optimization"]["stage"] == 2 and "reduce_bucket_size" in param_dict["zero_optimization"]


def make_model():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16))


def batches():
    generator = torch.Generator().manual_seed(9)
    return [(torch.randn(16, 16, generator=generator), torch.randn(16, 16, generator=generator)) for _ in range(3)]


def chunked_run(rank, world_size, stage, zero_extra):
    import deepspeed
    config = {"train_batch_size": 16, "gradient_clipping": 0.0,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.0, "torch_adam": True}},
              "zero_optimization": {"stage": stage, **zero_extra},
              "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "manual",
                                       "micro_batch_sizes": [10, 6],
                                       "emulation": {"memory_gb": [16, 8], "mode": "dilation"}},
              "heterogeneous_memory": {"enabled": True, "adaptive_chunking": True}}
    model = make_model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    offset, size = (0, 10) if rank == 0 else (10, 6)
    for inputs, targets in batches():
        loss = torch.nn.functional.mse_loss(engine(inputs[offset:offset + size]), targets[offset:offset + size])
        engine.backward(loss)
        engine.step()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        params = [p.detach().clone() for p in engine.module.parameters()]
    return {"chosen": engine.heterogeneous_state.chunk_sizes, "reduce": engine.zero_reduce_bucket_size(),
            "allgather": engine.zero_allgather_bucket_size(), "prefetch": engine.zero_prefetch_bucket_size(),
            "live": engine.zero_max_live_parameters(), "params": params}


@pytest.mark.multiprocess
def test_two_ranks_take_the_smaller_ranks_sizes_and_train_exactly():
    cases = [dict(stage=2, zero_extra={}), dict(stage=3, zero_extra={}),
             dict(stage=2, zero_extra={"reduce_bucket_size": 4096})]
    results = run_subcases(chunked_run, cases, world_size=2, timeout=300)
    # The smaller rank's 8 GiB (8,589,934,592 bytes) in 4-byte elements, each size rounded down to
    # a multiple of 1024: 2% -> 42,949,672 -> 42,949,632; 1% -> 21,474,836 -> 21,474,304;
    # 5% -> 107,374,182 -> 107,373,568.
    expected = {"reduce_bucket_size": 42_949_632, "allgather_bucket_size": 42_949_632,
                "stage3_prefetch_bucket_size": 21_474_304, "stage3_max_live_parameters": 107_373_568}
    inputs = torch.cat([b[0] for b in batches()])
    targets = torch.cat([b[1] for b in batches()])
    reference = adam_mse_reference(make_model(), inputs, targets, [list(range(16 * k, 16 * k + 16)) for k in range(3)],
                                   1e-2)
    for case, ranks in zip(cases, results):
        assert ranks[0]["chosen"] == ranks[1]["chosen"], case  # shapes collectives: equal on every rank
        for rank in ranks:
            if case["zero_extra"]:
                assert rank["reduce"] == 4096 and "reduce_bucket_size" not in rank["chosen"]
            else:
                assert rank["chosen"] == expected and rank["reduce"] == expected["reduce_bucket_size"]
                assert rank["prefetch"] == expected["stage3_prefetch_bucket_size"]
                assert rank["live"] == expected["stage3_max_live_parameters"]
            assert rank["allgather"] == expected["allgather_bucket_size"]
            for got, want in zip(rank["params"], reference):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=lambda m: f"{case}: {m}")
