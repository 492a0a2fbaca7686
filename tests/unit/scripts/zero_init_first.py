# SPDX-License-Identifier: Apache-2.0
"""``deepspeed.zero.Init`` as a script's first statement, before any process group exists, as
transformers enters it in ``from_pretrained``/``from_config``; run by
tests/unit/heterogeneous/test_zero_init_first.py under the deepspeed launcher.

Per-rank lists (a manual plan, emulated memory) must see the real data-parallel world there, and
``heterogeneous_memory.zero_partitions: "auto"`` must end, once the engine knows the model, on the
shares the engine gives the same model built without ``zero.Init``. Cases, in this order (the first
is the one that runs before any process group):

- ``init_auto``: built under ``zero.Init`` with ``"auto"`` (the config the engine gets too);
- ``plain_auto``: the same model built normally, the engine's own ``"auto"``;
- ``init_even``: cut into equal slices by ``zero.Init`` (``"even"``), the engine given ``"auto"``;
- ``init_list``: cut by ``zero.Init`` into an explicit list, which the engine (given ``"even"``, not
  ``"auto"``) keeps;
- ``plain_room``: built normally, ``"auto"`` with ``activation_bytes_per_sample``: the shares leave each
  rank room for its part of the micro-step (``memory/activation_room.py``), so rank 1's is smaller.

Each case trains ``STEPS`` SGD steps on the manual split [5, 3] and writes, per rank, the shares its
optimizer partitions with, the cut ``zero.Init`` made, and the trained parameters to
``<out>/<case>-rank<r>.pt``.

    deepspeed --num_gpus 2 tests/unit/scripts/zero_init_first.py --out DIR
"""

import argparse
import os

import torch

import deepspeed

WIDTH, LAYERS, STEPS, LR = 1024, 6, 2, 0.5
SIZES = [5, 3]
# Rank 1's emulated memory (by accounting: "dilation" mode, so every case sees the same empty device)
# binds for this model (25 MiB of fp32 parameters); rank 0's does not: "auto" gives rank 1 less than
# half. The speeds list is one more per-rank list that must meet the real world in zero.Init.
MEMORY_GB = [4.0, 0.06]
EMULATION = {"memory_gb": MEMORY_GB, "speeds": [1.0, 1.0], "mode": "dilation"}
BUCKET = 1_000_000


PER_SAMPLE = 2 * 2**20  # activation bytes of one sample, as plain_room's estimate


def config(zero_partitions, per_sample=None):
    return {"train_batch_size": sum(SIZES), "gradient_clipping": 0.0,
            "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": 3, "reduce_bucket_size": BUCKET, "stage3_prefetch_bucket_size": BUCKET,
                                  "stage3_max_live_parameters": BUCKET, "stage3_max_reuse_distance": BUCKET},
            "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "manual",
                                     "micro_batch_sizes": SIZES, "emulation": EMULATION},
            "heterogeneous_memory": {"enabled": True, "adaptive_chunking": False,
                                     "zero_partitions": zero_partitions, "activation_bytes_per_sample": per_sample}}


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def batches():
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(sum(SIZES), WIDTH, generator=generator) for _ in range(STEPS)]


def run_case(name, init_partitions, engine_partitions, rank, out, per_sample=None):
    if init_partitions is None:
        model = make_model()
        cut = None
    else:
        with deepspeed.zero.Init(config_dict_or_path=config(init_partitions)):
            model = make_model()
        cut = [int(p.ds_tensor.numel()) for p in model.parameters()]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config(engine_partitions, per_sample))
    local = [int(p.ds_tensor.numel()) for p in engine.module.parameters()]
    for rows in batches():
        mine = rows[sum(SIZES[:rank]):sum(SIZES[:rank + 1])]
        engine.backward(engine(mine).pow(2).mean())
        engine.step()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        params = [p.detach().clone() for p in engine.module.parameters()]
    torch.save({"shares": engine.optimizer.zero3_shares, "cut": cut, "local": local, "params": params,
                "world": int(engine._config.world_size)}, os.path.join(out, f"{name}-rank{rank}.pt"))
    engine.destroy()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    # The first case builds its model before anything else touches torch.distributed.
    assert not torch.distributed.is_initialized()
    run_case("init_auto", "auto", "auto", int(os.environ["RANK"]), args.out)
    rank = torch.distributed.get_rank()
    run_case("plain_auto", None, "auto", rank, args.out)
    run_case("init_even", "even", "auto", rank, args.out)
    run_case("init_list", [0.75, 0.25], "even", rank, args.out)
    run_case("plain_room", None, "auto", rank, args.out, per_sample=PER_SAMPLE)


if __name__ == "__main__":
    main()
