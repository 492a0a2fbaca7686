# SPDX-License-Identifier: Apache-2.0
"""With a model-parallel ``mpu`` the plan is indexed by data-parallel rank, not global rank.

Four ranks form two tensor-parallel pairs, {0, 1} and {2, 3}; the data-parallel groups are {0, 2}
and {1, 3}, so global rank 1 is data-parallel rank 0. Both members of a pair hold the same
(replicated) model and take the same samples, as tensor-parallel ranks do. Training must still
equal a single-process reference on the global batch.
"""

import pytest
import torch

from harness import run_subcases

WIDTH = 16
LR = 1e-2
STEPS = 4
TENSOR_PARALLEL = 2


class PairMpu:
    """Megatron-style topology: model-parallel pairs of consecutive ranks."""

    def __init__(self):
        import torch.distributed as dist

        rank, world = dist.get_rank(), dist.get_world_size()
        self.mp_rank, self.dp_rank = rank % TENSOR_PARALLEL, rank // TENSOR_PARALLEL
        self.dp_world = world // TENSOR_PARALLEL
        # Every rank creates every group, in the same order (new_group is collective).
        for start in range(0, world, TENSOR_PARALLEL):
            group = dist.new_group(list(range(start, start + TENSOR_PARALLEL)))
            if rank // TENSOR_PARALLEL == start // TENSOR_PARALLEL:
                self.mp_group = group
        for offset in range(TENSOR_PARALLEL):
            ranks = list(range(offset, world, TENSOR_PARALLEL))
            group = dist.new_group(ranks)
            if self.mp_rank == offset:
                self.dp_group, self.dp_ranks = group, ranks

    def get_model_parallel_rank(self):
        return self.mp_rank

    def get_model_parallel_world_size(self):
        return TENSOR_PARALLEL

    def get_model_parallel_group(self):
        return self.mp_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_tensor_model_parallel_src_rank(self):
        return self.dp_rank * TENSOR_PARALLEL

    def get_data_parallel_rank(self):
        return self.dp_rank

    def get_data_parallel_world_size(self):
        return self.dp_world

    def get_data_parallel_group(self):
        return self.dp_group

    def get_data_parallel_group_ranks(self):
        return self.dp_ranks


def make_model():
    torch.manual_seed(11)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, 32), torch.nn.Tanh(), torch.nn.Linear(32, WIDTH))


def global_batches(train_batch):
    generator = torch.Generator().manual_seed(2)
    return [(torch.randn(train_batch, WIDTH, generator=generator), torch.randn(train_batch, WIDTH,
                                                                                generator=generator))
            for _ in range(STEPS)]


def train_with_mpu(rank, world_size, stage, strategy):
    import deepspeed

    mpu = PairMpu()
    heterogeneous = {"enabled": True, "load_balancing_strategy": strategy, "profile_steps": 2}
    if strategy == "manual":
        heterogeneous["micro_batch_sizes"] = [5, 3]
    config = {"train_batch_size": 8, "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "Adam", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
              "heterogeneous_config": heterogeneous}
    model = make_model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config, mpu=mpu)
    sizes_seen = []
    for inputs, targets in global_batches(8):
        sizes = list(engine.heterogeneous_plan.micro_batch_sizes)
        sizes_seen.append(engine.train_micro_batch_size_per_gpu())
        assert sizes_seen[-1] == sizes[mpu.dp_rank]
        start = sum(sizes[:mpu.dp_rank])
        chunk = slice(start, start + sizes[mpu.dp_rank])
        engine.backward(torch.nn.functional.mse_loss(engine(inputs[chunk]), targets[chunk]))
        engine.step()
    return {"dp_rank": mpu.dp_rank, "sizes": sizes_seen, "plan": list(engine.heterogeneous_plan.micro_batch_sizes),
            "params": [p.detach().clone() for p in engine.module.parameters()]}


def reference():
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    for inputs, targets in global_batches(8):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    return list(model.parameters())


@pytest.mark.multiprocess
def test_plan_follows_the_data_parallel_rank_and_training_stays_exact():
    cases = [dict(stage=1, strategy="manual"), dict(stage=0, strategy="compute_aware")]
    expected = reference()
    for case, ranks in zip(cases, run_subcases(train_with_mpu, cases, world_size=4, timeout=600)):
        assert [r["dp_rank"] for r in ranks] == [0, 0, 1, 1]
        if case["strategy"] == "manual":
            # Global rank 1 runs data-parallel rank 0's share, global rank 2 data-parallel rank 1's.
            assert [r["sizes"][0] for r in ranks] == [5, 5, 3, 3], case
        # Both members of a tensor-parallel pair ran the same plan (re-planned over the dp group).
        assert ranks[0]["plan"] == ranks[1]["plan"] == ranks[2]["plan"] == ranks[3]["plan"]
        for result in ranks:
            for got, want in zip(result["params"], expected):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=lambda m: f"{case}: {m}")
