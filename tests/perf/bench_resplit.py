# SPDX-License-Identifier: Apache-2.0
"""Stock loaders re-split by the engine, side by side with the zero-transfer sampler and uniform.

A small GPT (examples/tiny_gpt, ``GPTConfig.demo()``, seq_len 64, vocab 256) on two CPU ranks,
rank 1 emulated at 0.4 of rank 0's speed (time dilation), global batch 16, the plan fixed at
[12, 4] (``manual``) so that every run computes the same split. Runs, in one invocation:

- ``uniform``: a stock ``DistributedSampler`` loader with the plan [8, 8] (upstream's split);
- ``sampler``: ``engine.heterogeneous_sampler`` feeds each rank its share (nothing moves);
- ``stock, loss inside``: the stock loader, ``engine(x, targets=y)`` returns the loss (0-dim: only
  the inputs move);
- ``stock, loss outside``: the stock loader, ``F.cross_entropy(engine(x), y)``: the logits
  (n x 64 x 256 fp32) return to the ranks fed them.

It prints samples/s, the ratio to ``uniform`` and to ``sampler``, and per step the input and
output bytes the ranks received from each other, and writes ``tests/perf/results/resplit.json``.
Target (reported, not asserted): re-split loops within 10% of the sampler's throughput.

A second table (skipped with ``--no-trainer``, or without transformers) compares the Hugging Face
Trainers on a tiny GPT-2 (2 layers, width 128, seq_len 64, vocab 256) on the same emulated
cluster and plan: the stock ``transformers.Trainer`` (equal batches, re-split by the engine; its
model computes the loss from ``labels`` and returns the logits, which return to the ranks fed
them), the same with ``return_outputs: false`` (a training forward's loss is all the Trainer
reads: only the inputs move) and ``HeterogeneousTrainer`` (each rank's loader feeds its share: the
zero-transfer path).

    python tests/perf/bench_resplit.py [--steps N] [--no-trainer]   (from the repository root, ~4 min)
"""

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "unit")]

from harness import run_subcases  # noqa: E402

BATCH, SEQ, SPEEDS, PLAN, WARMUP = 16, 64, [1.0, 0.4], [12, 4], 3
RESULTS = REPO / "tests" / "perf" / "results" / "resplit.json"
TARGET = 0.90


def _run(rank, world_size, mode, steps):
    import deepspeed
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, DistributedSampler
    from examples.tiny_gpt.data import TokenDataset, split_batch
    from examples.tiny_gpt.model import GPT, GPTConfig

    config = GPTConfig.demo()
    config.seq_len = SEQ
    model = GPT(config, seed=0)
    plan = [8, 8] if mode == "uniform" else PLAN
    ds_config = {"train_batch_size": BATCH, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                 "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "manual",
                                          "micro_batch_sizes": plan,
                                          "emulation": {"speeds": SPEEDS, "mode": "dilation"}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    data = TokenDataset(seq_len=SEQ, num_samples=BATCH * (steps + WARMUP), seed=1)
    if mode == "sampler":
        loader = DataLoader(data, batch_sampler=engine.heterogeneous_sampler(data, shuffle=False))
    else:
        loader = DataLoader(data, batch_size=BATCH // world_size, drop_last=True,
                            sampler=DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=False))
    runtime = engine._heterogeneous_runtime()
    began = None
    for step, batch in enumerate(loader):
        if step == WARMUP:
            began = time.perf_counter()
            inputs0, outputs0 = runtime.exchange.input_bytes, runtime.exchange.output_bytes
        if step == WARMUP + steps:
            break
        x, y = split_batch(batch)
        if mode == "stock, loss outside":
            logits = engine(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        else:
            loss = engine(x, targets=y)
        engine.backward(loss)
        engine.step()
    seconds = time.perf_counter() - began
    return {"seconds": seconds, "samples_per_s": BATCH * steps / seconds,
            "input_bytes_per_step": (runtime.exchange.input_bytes - inputs0) / steps,
            "output_bytes_per_step": (runtime.exchange.output_bytes - outputs0) / steps,
            "plan": list(engine.heterogeneous_plan.micro_batch_sizes)}


def _trainer_run(rank, world_size, mode, steps):
    """One Trainer run: samples/s over the steps after WARMUP, bytes re-split per step."""
    import os
    import time as clock
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
    from deepspeed.runtime.heterogeneous.integrations.hf_trainer import HeterogeneousTrainer

    config = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=256, n_positions=SEQ, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"
    ids = torch.randint(0, 256, (BATCH * (steps + WARMUP), SEQ), generator=torch.Generator().manual_seed(1))

    class Tokens(torch.utils.data.Dataset):

        def __len__(self):
            return len(ids)

        def __getitem__(self, index):
            return {"input_ids": ids[index], "labels": ids[index].clone()}

    marks = {}

    class Clock(TrainerCallback):

        def on_step_end(self, args, state, control, **kwargs):
            runtime = trainer.model_wrapped._heterogeneous_runtime()
            if state.global_step in (WARMUP, WARMUP + steps):
                marks[state.global_step] = (clock.perf_counter(), runtime.exchange.input_bytes,
                                            runtime.exchange.output_bytes)

    ds_config = {"train_batch_size": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                 "zero_optimization": {"stage": 1},
                 "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                           "weight_decay": "auto", "torch_adam": True}},
                 "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "manual",
                                          "micro_batch_sizes": PLAN,
                                          "emulation": {"speeds": SPEEDS, "mode": "dilation"}}}
    if mode == "Trainer (stock), no outputs":
        ds_config["heterogeneous_config"]["return_outputs"] = False  # the Trainer reads only the loss
    args = TrainingArguments(output_dir=os.path.join(os.environ.get("TMPDIR", "/tmp"), f"bench-resplit-{rank}"),
                             per_device_train_batch_size=BATCH // world_size, max_steps=WARMUP + steps,
                             learning_rate=1e-3, lr_scheduler_type="constant", max_grad_norm=0.0, seed=1,
                             deepspeed=ds_config, report_to=[], save_strategy="no", logging_strategy="no",
                             disable_tqdm=True, use_cpu=True)
    kind = HeterogeneousTrainer if mode == "HeterogeneousTrainer" else Trainer
    trainer = kind(model=model, args=args, train_dataset=Tokens(), callbacks=[Clock()])
    trainer.train()
    (began, inputs0, outputs0), (ended, inputs1, outputs1) = marks[WARMUP], marks[WARMUP + steps]
    plan = list(trainer.model_wrapped.heterogeneous_plan.micro_batch_sizes)
    return {"samples_per_s": BATCH * steps / (ended - began), "plan": plan,
            "input_bytes_per_step": (inputs1 - inputs0) / steps, "output_bytes_per_step": (outputs1 - outputs0) / steps}


def _print_rows(rows, reference):
    print(f"{'run':27s} {'plan':9s} {'samples/s':>9s} {'vs ' + reference:>22s} "
          f"{'input B/step':>12s} {'output B/step':>13s}")
    for mode, row in rows.items():
        print(f"{mode:27s} {str(row['plan']):9s} {row['samples_per_s']:9.1f} {row['vs_reference']:22.2f} "
              f"{row['input_bytes_per_step']:12.0f} {row['output_bytes_per_step']:13.0f}")


def _trainer_rows(steps):
    import importlib.util
    if importlib.util.find_spec("transformers") is None:
        print("transformers is not installed: no Trainer rows")
        return None
    modes = ["Trainer (stock)", "Trainer (stock), no outputs", "HeterogeneousTrainer"]
    results = run_subcases(_trainer_run, [dict(mode=mode, steps=steps) for mode in modes], world_size=2,
                           timeout=1800)
    rows = {}
    for mode, ranks in zip(modes, results):
        rows[mode] = {"samples_per_s": min(r["samples_per_s"] for r in ranks), "plan": ranks[0]["plan"],
                      "input_bytes_per_step": sum(r["input_bytes_per_step"] for r in ranks),
                      "output_bytes_per_step": sum(r["output_bytes_per_step"] for r in ranks)}
    for row in rows.values():
        row["vs_reference"] = row["samples_per_s"] / rows["HeterogeneousTrainer"]["samples_per_s"]
    print()
    _print_rows(rows, "HeterogeneousTrainer")
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--no-trainer", action="store_true", help="skip the Hugging Face Trainer rows")
    args = parser.parse_args()
    modes = ["uniform", "sampler", "stock, loss inside", "stock, loss outside"]
    results = run_subcases(_run, [dict(mode=mode, steps=args.steps) for mode in modes], world_size=2, timeout=1800)
    rows = {}
    for mode, ranks in zip(modes, results):
        rows[mode] = {"samples_per_s": min(r["samples_per_s"] for r in ranks), "plan": ranks[0]["plan"],
                      "input_bytes_per_step": sum(r["input_bytes_per_step"] for r in ranks),
                      "output_bytes_per_step": sum(r["output_bytes_per_step"] for r in ranks)}
    uniform, sampler = rows["uniform"]["samples_per_s"], rows["sampler"]["samples_per_s"]
    print(f"{'run':22s} {'plan':9s} {'samples/s':>9s} {'vs uniform':>10s} {'vs sampler':>10s} "
          f"{'input B/step':>12s} {'output B/step':>13s}")
    for mode, row in rows.items():
        row["vs_uniform"] = row["samples_per_s"] / uniform
        row["vs_sampler"] = row["samples_per_s"] / sampler
        print(f"{mode:22s} {str(row['plan']):9s} {row['samples_per_s']:9.1f} {row['vs_uniform']:10.2f} "
              f"{row['vs_sampler']:10.2f} {row['input_bytes_per_step']:12.0f} {row['output_bytes_per_step']:13.0f}")
    worst = min(rows[m]["vs_sampler"] for m in modes if m.startswith("stock"))
    print(f"target: re-split loops >= {TARGET:.0%} of the sampler's throughput: worst {worst:.0%} "
          f"({'met' if worst >= TARGET else 'NOT met'})")
    trainer_rows = None if args.no_trainer else _trainer_rows(args.steps)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"steps": args.steps, "speeds": SPEEDS, "rows": rows, "target": TARGET,
                                   "trainer_rows": trainer_rows}, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
