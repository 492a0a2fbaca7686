# SPDX-License-Identifier: Apache-2.0
"""What the per-forward feeding agreement costs, as a share of a training step.

Every training forward (outside a pipeline and per-rank-gas plans) gathers, from every rank, its
data-parallel rank, whether the plan's own loader feeds it, its fed size and whether it was given
a count (``runtime._agree_on_feeding``: one all-gather of four integers). Measured side by side
on the same two CPU ranks (gloo), in one run:

- ``agreement``: the all-gather alone (``data.resplit.agree``), repeated;
- ``step``: a whole training step of the small GPT (examples/tiny_gpt, ``GPTConfig.demo()``,
  seq_len 64, global batch 16, ZeRO-1, plan [8, 8] fed by ``engine.heterogeneous_sampler``), which
  includes one agreement.

It prints both per call and their ratio, and writes ``tests/perf/results/feeding_agreement.json``.
The ratio is what matters; on an accelerator the agreement also synchronises the host at each
forward, which this CPU run cannot show.

    python tests/perf/bench_feeding_agreement.py [--steps N] [--calls N]   (from the repository root, ~1 min)
"""

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "unit")]

from harness import run_subcases  # noqa: E402

BATCH, SEQ, WARMUP = 16, 64, 3
RESULTS = REPO / "tests" / "perf" / "results" / "feeding_agreement.json"


def _measure(rank, world_size, steps, calls):
    import deepspeed
    import torch
    import torch.nn.functional as F
    from examples.tiny_gpt.data import TokenDataset, split_batch
    from examples.tiny_gpt.model import GPT, GPTConfig
    from deepspeed.runtime.heterogeneous.data.resplit import agree

    config = GPTConfig.demo()
    config.seq_len = SEQ
    model = GPT(config, seed=0)
    ds_config = {"train_batch_size": BATCH, "zero_optimization": {"stage": 1},
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                 "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "manual",
                                          "micro_batch_sizes": [8, 8]}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    data = TokenDataset(seq_len=SEQ, num_samples=BATCH * (steps + WARMUP), seed=1)
    loader = torch.utils.data.DataLoader(data, batch_sampler=engine.heterogeneous_sampler(data, seed=0))
    batches = iter(loader)
    for step in range(steps + WARMUP):
        if step == WARMUP:
            torch.distributed.barrier()
            began = time.perf_counter()
        inputs, targets = split_batch(next(batches))
        logits = engine(inputs)
        engine.backward(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)))
        engine.step()
    step_s = (time.perf_counter() - began) / steps
    for _ in range(WARMUP * 10):
        agree(rank, 1, 8, 0)
    torch.distributed.barrier()
    began = time.perf_counter()
    for _ in range(calls):
        agree(rank, 1, 8, 0)
    return {"step_s": step_s, "agreement_s": (time.perf_counter() - began) / calls}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    per_rank = run_subcases(_measure, [dict(steps=args.steps, calls=args.calls)], world_size=2, timeout=600)[0]
    step_s = max(r["step_s"] for r in per_rank)
    agreement_s = max(r["agreement_s"] for r in per_rank)
    report = {"step_s": step_s, "agreement_s": agreement_s, "agreement_share_of_step": agreement_s / step_s,
              "steps": args.steps, "calls": args.calls}
    print(f"training step (one agreement included): {step_s * 1e3:.2f} ms")
    print(f"feeding agreement alone:                {agreement_s * 1e3:.3f} ms")
    print(f"agreement / step:                       {agreement_s / step_s:.2%}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
