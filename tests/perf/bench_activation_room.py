# SPDX-License-Identifier: Apache-2.0
"""ZeRO-3 state shares and micro-batches chosen together, beside the shares chosen alone.

A 19M-parameter GPT-2 (transformers, 8 layers of width 256, its 50257-token vocabulary, sequences of
32), ZeRO-3, Adam in fp32, global batch 16 (``--batch``), two ranks at equal speeds, the compute-aware planner
after its profiling steps. Rank 1's memory is emulated by accounting at 0.24 GB, rank 0's at 16 GB:
the state is 0.28 GiB, so rank 1 cannot hold half of it and half the batch. Arms, run alternately:

- ``unbound``: both ranks at 16 GB, the step the even split gives (the goal to approach);
- ``alone``: ``heterogeneous_memory.zero_partitions: "auto"`` as before this change, shares from memory
  and speed alone: rank 1's share fills its room and the planner gives it what is left;
- ``together``: ``"auto"`` with ``activation_bytes_per_sample`` set to what ``alone``'s profiling
  measured (its note), so the shares leave rank 1 room for its part of the batch.

After profiling, ``alone`` and ``together`` each forecast their own step and the other's (the shares
with the room reserved, or without it) from the measured forward+backward, optimizer step and
collectives, and advise accordingly (``activation_room.weigh_shares``); the bench sets each forecast
beside the step the other arm measured (``forecast_check``).

Reported per arm: the shares, the plan after profiling, samples/s (median over ``--repeats``), and
the speed of ``together`` and ``alone`` relative to ``unbound``. Writes
tests/perf/results/activation_room_b<batch>.json.

    python tests/perf/bench_activation_room.py [--repeats 2] [--batch 16]
"""

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "unit")]

from harness import run_ranks  # noqa: E402

RESULTS = REPO / "tests" / "perf" / "results" / "activation_room_b{batch}.json"
SEQ, VOCAB = 32, 50257
PROFILE_STEPS, WARMUP_STEPS, MEASURED_STEPS = 3, 2, 6
MEMORY = {"unbound": [16.0, 16.0], "alone": [16.0, 0.24], "together": [16.0, 0.24]}


def _train(rank, world_size, memory_gb, per_sample, global_batch):
    import logging
    import torch
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.utils import logger
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=8, n_embd=256, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    memory = {"enabled": True, "zero_partitions": "auto"}
    if per_sample:
        memory["activation_bytes_per_sample"] = int(per_sample)
    config = {"train_batch_size": global_batch, "steps_per_print": 10**6,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
              "zero_optimization": {"stage": 3},
              "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "compute_aware",
                                       "profile_steps": PROFILE_STEPS,
                                       "emulation": {"memory_gb": memory_gb, "speeds": [1.0, 1.0],
                                                     "mode": "dilation"}},
              "heterogeneous_memory": memory}
    notes = []

    class Notes(logging.Handler):  # rank 0's log lines, beside what it prints (the plan's notes)
        def emit(self, record):
            notes.append(record.getMessage())

    class Tee:
        def __init__(self, stream):
            self.stream = stream

        def write(self, text):
            notes.append(text)
            return self.stream.write(text)

        def __getattr__(self, name):
            return getattr(self.stream, name)

    handler, stdout = Notes(), sys.stdout
    logger.addHandler(handler)
    sys.stdout = Tee(stdout)
    try:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        generator = torch.Generator().manual_seed(rank)

        def step():
            sizes = engine.heterogeneous_plan.micro_batch_sizes
            ids = torch.randint(0, VOCAB, (sizes[rank], SEQ), generator=generator)
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()

        for _ in range(PROFILE_STEPS + WARMUP_STEPS):
            step()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(MEASURED_STEPS):
            step()
        dist.barrier()
        elapsed = time.perf_counter() - start
    finally:
        logger.removeHandler(handler)
        sys.stdout = stdout
    # The line after profiling: the value to set, or (where its forecast says the step would not be
    # faster) the activations measured; the forecast of the other shares' step against the current one.
    measured = [re.search(r"activation_bytes_per_sample to (\d+)|measured: (\d+) bytes per sample", n) for n in notes]
    measured = next((int(m.group(1) or m.group(2)) for m in measured if m), None)
    forecast = [re.search(r"forecast ([\d.e+-]+) s per step against ([\d.e+-]+) s now", n) for n in notes]
    forecast = next(({"other_s": float(m.group(1)), "current_s": float(m.group(2))} for m in forecast if m), None)
    advice = next(("set" if "activation_bytes_per_sample to" in n else "remove" if "Remove activation_bytes" in n
                   else "stay" for n in notes if "forecast " in n), None)
    return {"samples_per_s": global_batch * MEASURED_STEPS / elapsed,
            "plan": list(engine.heterogeneous_plan.micro_batch_sizes),
            "shares": [round(s, 4) for s in engine.optimizer.zero3_shares] if engine.optimizer.zero3_shares else None,
            "measured_bytes_per_sample": measured, "forecast": forecast, "advice": advice}


def measure(name, per_sample=None, global_batch=16):
    result = run_ranks(_train, world_size=2, timeout=1200, args=(MEMORY[name], per_sample, global_batch))[0]
    result["load_average"] = os.getloadavg()[0]
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16, help="the global batch (samples per step)")
    args = parser.parse_args()
    runs = {"unbound": [], "alone": [], "together": []}
    per_sample = None
    started = time.perf_counter()
    for repeat in range(args.repeats):
        for name in runs:
            if name == "together" and per_sample is None:
                raise SystemExit("the 'alone' arm found no starved rank and measured nothing: nothing to compare")
            result = measure(name, per_sample if name == "together" else None, args.batch)
            if name == "alone" and per_sample is None:
                per_sample = result["measured_bytes_per_sample"]
            runs[name].append(result)
            print(f"[{time.perf_counter() - started:5.0f} s] run {repeat + 1}/{args.repeats} {name:8s}: "
                  f"{result['samples_per_s']:6.1f} samples/s, plan {result['plan']}, shares {result['shares']}, "
                  f"load {result['load_average']:.1f}; advice {result['advice']}, forecast {result['forecast']}",
                  flush=True)
    medians = {name: statistics.median(r["samples_per_s"] for r in rs) for name, rs in runs.items()}
    ratios = {name: medians[name] / medians["unbound"] for name in ("alone", "together")}
    for name in runs:
        last = runs[name][-1]
        print(f"{name:8s}: shares {last['shares']}, plan {last['plan']}, {medians[name]:.1f} samples/s"
              + (f" ({ratios[name]:.2f}x unbound)" if name in ratios else ""))
    print(f"activation_bytes_per_sample used by 'together': {per_sample} (measured by 'alone')")
    step_s = {name: args.batch / medians[name] for name in runs}
    check = {}
    for name, other in (("alone", "together"), ("together", "alone")):
        forecasts = [r["forecast"] for r in runs[name] if r["forecast"]]
        if not forecasts:
            continue
        current = statistics.median(f["current_s"] for f in forecasts)
        predicted = statistics.median(f["other_s"] for f in forecasts)
        check[name] = {"advice": runs[name][-1]["advice"], "own_forecast_s": current, "own_measured_s": step_s[name],
                       "other_forecast_s": predicted, "other_measured_s": step_s[other],
                       "other_error": predicted / step_s[other] - 1.0}
        print(f"{name:8s} forecast its own step {current:.3g} s (measured {step_s[name]:.3g} s) and {other}'s "
              f"{predicted:.3g} s (measured {step_s[other]:.3g} s, {check[name]['other_error']:+.0%}); "
              f"advice: {check[name]['advice']}")
    results = Path(str(RESULTS).format(batch=args.batch))
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps({"memory_gb": MEMORY, "global_batch": args.batch, "per_sample_bytes": per_sample,
                                   "medians": medians, "ratios_to_unbound": ratios, "forecast_check": check,
                                   "runs": runs}, indent=1) + "\n")
    print(f"wrote {results.relative_to(REPO)}")


if __name__ == "__main__":
    main()
