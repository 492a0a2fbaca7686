# SPDX-License-Identifier: Apache-2.0
"""The largest model ZeRO-3 trains on two ranks of unequal memory: upstream against the fork.

Rank 0 may use 1.5 GiB, rank 1 0.5 GiB (physical limits: a memory cgroup per rank, joined as the
engine starts, so a rank over its limit is killed as a GPU runs out of memory). Upstream gives
both ranks equal slices of every parameter, so rank 1 bounds the model; the fork
(``heterogeneous_memory.enabled``, ``zero_partitions: "auto"``) gives each rank the share of every
parameter its memory holds, and (``compute_aware``) each rank the micro-batch its memory holds once the
first step has measured the activations. Both run the same ZeRO-3 settings (Adam, fp32, global batch 8, buckets,
live parameters and reuse distance of 2e6 elements, as a user of small devices sets them); the
fork's emulated device is its limit less the 256 MiB host allowance its cgroup adds.

For each model family, the size grows (doubling, then bisection on the integer size) until a run
fails: killed by the kernel, or refused by the fork's own memory check, at start-up or once the
first step has measured the activations (it never lets the kernel kill). Reported: the largest size and parameter count each trains 2 steps with,
and the ratio fork / upstream (goal: >= 1.5).

- ``mlp``: 12 x Linear(W, W), W in multiples of 128;
- ``gpt``: a small GPT (vocabulary 8192, width 384, 6 heads, sequence 128) of L layers;
- ``hf-gpt2``: through the front door, as users reach ZeRO-3: ``TrainingArguments`` with the ZeRO-3
  config, then ``AutoModelForCausalLM.from_config`` (GPT-2, vocabulary 8192, width 384, 6 heads,
  sequence 128, L layers), which builds the model under ``zero.Init`` before the engine exists, and
  the stock ``Trainer``. Each rank's limit is set from outside (a memory cgroup joined before the
  model is built, as a device's memory is there from the start; the fork reads it as the rank's
  capacity): the fork's ``"auto"`` is cut by ``zero.Init`` from the gathered budgets and cut again
  by the engine once it sees the model.

    python tests/perf/bench_zero3_capacity.py [--models mlp gpt hf-gpt2]

Writes tests/perf/results/zero3_capacity.json. Needs root and the cgroup memory controller
(about 15 min on 2 cores).
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "unit"), str(REPO / "tests" / "unit" / "heterogeneous"),
                str(REPO / "tests" / "perf")]

from harness import run_ranks  # noqa: E402

LIMITS_GIB = (1.5, 0.5)
HOST_ALLOWANCE_GIB = 0.25  # emulation/cgroups.py HOST_ALLOWANCE_BYTES
BUCKET = 2_000_000
STEPS, GLOBAL_BATCH = 3, 8
RESULTS = REPO / "tests" / "perf" / "results" / "zero3_capacity.json"


def build(model, size):
    import torch
    torch.manual_seed(0)
    if model == "mlp":
        return torch.nn.Sequential(*[torch.nn.Linear(size, size) for _ in range(12)])
    from bench_memory_model import _tiny_gpt_class
    return _tiny_gpt_class()(layers=size)


def _train(rank, world_size, system, model, size):
    import torch
    import deepspeed
    from deepspeed.runtime.heterogeneous.emulation import emulator as emulation
    from deepspeed.runtime.heterogeneous.memory.meter import load_engine_modules
    from bench_memory_model import loss_of

    load_engine_modules()  # the engine's imports are the process's memory, in both systems
    config = {"train_batch_size": GLOBAL_BATCH, "gradient_clipping": 0.0, "steps_per_print": 10**6,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": 3, "reduce_bucket_size": BUCKET, "stage3_prefetch_bucket_size": BUCKET,
                                    "stage3_max_live_parameters": BUCKET, "stage3_max_reuse_distance": BUCKET}}
    if system == "upstream":
        config["train_micro_batch_size_per_gpu"] = GLOBAL_BATCH // world_size
    else:
        device_gb = [limit - HOST_ALLOWANCE_GIB for limit in LIMITS_GIB]
        # compute_aware: a rank's micro-batch follows what its memory holds (activations measured at
        # the first step), as the shares follow it for the model state.
        config["heterogeneous_config"] = {"enabled": True, "load_balancing_strategy": "compute_aware",
                                          "profile_steps": 1,
                                          "emulation": {"memory_gb": device_gb, "mode": "cgroup"}}
        config["heterogeneous_memory"] = {"enabled": True, "adaptive_chunking": False, "zero_partitions": "auto"}
    module = build(model, size)
    parameters = sum(p.numel() for p in module.parameters())
    if system == "upstream":
        cgroup = emulation.MemoryLimitCgroup(int(LIMITS_GIB[rank] * 2**30), label=f"capacity{rank}")
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=module.parameters(), config=config)
    per_rank = GLOBAL_BATCH // world_size
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(step)
        sizes = list(engine.heterogeneous_plan.micro_batch_sizes) if system == "fork" else [per_rank] * world_size
        first = sum(sizes[:rank])
        rows = (torch.randint(0, 8192, (GLOBAL_BATCH, 129), generator=generator) if model == "gpt" else
                torch.randn(GLOBAL_BATCH, size, generator=generator))[first:first + sizes[rank]]
        engine.backward(loss_of("gpt" if model == "gpt" else "mlp", engine, rows))
        engine.step()
    if system != "upstream":
        cgroup = emulation._memory_cgroup
    path = cgroup.path
    peak = next(int((path / n).read_text()) for n in ("memory.max_usage_in_bytes", "memory.peak") if (path / n).exists())
    cgroup.close()
    plan = getattr(engine, "heterogeneous_plan", None)
    return {"parameters": parameters, "peak_mib": peak / 2**20, "shares": getattr(engine.optimizer, "zero3_shares", None),
            "micro_batches": None if plan is None else list(plan.micro_batch_sizes)}


def _train_front_door(rank, world_size, system, layers, zero_partitions=None):
    """``hf-gpt2``: the Trainer's road to ZeRO-3 under a limit set from outside before the model exists
    (``zero_partitions``: a list in place of the default "auto")."""
    import tempfile
    import torch
    from deepspeed.runtime.heterogeneous.memory.meter import load_engine_modules
    from test_zero3_memory_limits import outside_limit
    from transformers import AutoModelForCausalLM, GPT2Config, Trainer, TrainingArguments

    load_engine_modules()

    class Tokens(torch.utils.data.Dataset):

        def __len__(self):
            return GLOBAL_BATCH * STEPS

        def __getitem__(self, index):
            ids = torch.randint(0, 8192, (128, ), generator=torch.Generator().manual_seed(index))
            return {"input_ids": ids, "labels": ids.clone()}

    config = {"train_batch_size": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
              "steps_per_print": 10**6, "optimizer": {"type": "Adam", "params": {"lr": "auto", "torch_adam": True}},
              "zero_optimization": {"stage": 3, "reduce_bucket_size": BUCKET, "stage3_prefetch_bucket_size": BUCKET,
                                    "stage3_max_live_parameters": BUCKET, "stage3_max_reuse_distance": BUCKET}}
    if system == "fork":
        config["heterogeneous_config"] = {"enabled": True, "load_balancing_strategy": "compute_aware",
                                          "profile_steps": 1}
        # zero_partitions "auto" is the default; written out, accelerate would take it for one of its own
        # "auto" values and stop.
        config["heterogeneous_memory"] = {"enabled": True, "adaptive_chunking": False,
                                          **({"zero_partitions": zero_partitions} if zero_partitions else {})}
    with tempfile.TemporaryDirectory() as out, outside_limit(int(LIMITS_GIB[rank] * 2**30)) as path:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=GLOBAL_BATCH // world_size,
                                 max_steps=STEPS, learning_rate=1e-3, max_grad_norm=0.0, deepspeed=config,
                                 report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True,
                                 use_cpu=True)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(GPT2Config(n_layer=layers, n_embd=384, n_head=6, vocab_size=8192,
                                                            n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0,
                                                            attn_pdrop=0.0, use_cache=False))
        parameters = sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())
        trainer = Trainer(model=model, args=args, train_dataset=Tokens())
        trainer.train()
        peak = next(int((path / n).read_text()) for n in ("memory.max_usage_in_bytes", "memory.peak")
                    if (path / n).exists())
        engine = trainer.model_wrapped
        plan = getattr(engine, "heterogeneous_plan", None)
        result = {"parameters": parameters, "peak_mib": peak / 2**20,
                  "shares": getattr(engine.optimizer, "zero3_shares", None),
                  "micro_batches": None if plan is None else list(plan.micro_batch_sizes)}
        trainer.accelerator.free_memory()
        del trainer, engine, model
    return result


def attempt(system, model, size):
    """('trained' | 'killed' | 'refused' | 'failed', details)."""
    try:
        train = _train_front_door if model == "hf-gpt2" else _train
        results = run_ranks(train, world_size=2, timeout=900, args=(system, size) if model == "hf-gpt2" else
                            (system, model, size))
        return "trained", results
    except AssertionError as error:
        text = str(error)
        from deepspeed.runtime.heterogeneous.emulation.cgroups import remove_stale_cgroups_everywhere
        remove_stale_cgroups_everywhere()
        _remove_outside_cgroups()
        if "exited with code -9" in text:
            return "killed", text[-300:]
        for refusal in ("no placement fits", "no plan fits"):  # at start-up, or once the first step measured
            if refusal in text:
                return "refused", text[text.index(refusal):][:300]
        return "failed", text[-600:]


def _remove_outside_cgroups():
    """A killed rank's outside cgroup (``hf-gpt2``) is left behind: remove it once it is empty."""
    from deepspeed.runtime.heterogeneous.measure.cgroup_files import find_hierarchy, placement
    from test_zero3_memory_limits import OUTSIDE_PREFIX
    for stale in Path(placement(find_hierarchy("memory"))).glob(f"{OUTSIDE_PREFIX}*"):
        try:
            stale.rmdir()
        except OSError:
            pass


def largest(system, model, start, unit):
    """The largest size (a multiple of ``unit``) that trains: doubling (or halving) from ``start``
    to the first change of outcome, then bisection. Returns ``(size, per-rank results) or None``
    and the trials."""
    trials = []

    def run(size):
        outcome, details = attempt(system, model, size)
        trials.append({"size": size, "outcome": outcome, "details": details if outcome != "trained" else None})
        print(f"  {system:8s} {model} {size:6d}: {outcome}", flush=True)
        return (size, details) if outcome == "trained" else None

    good, bad = run(start), None
    if good is not None:
        while bad is None:
            trained = run(good[0] * 2)
            good, bad = (trained, None) if trained else (good, good[0] * 2)
    else:
        bad, size = start, start // 2
        while good is None and size >= unit:
            good = run(size)
            bad, size = (size, size // 2) if good is None else (bad, size)
        if good is None:
            return None, trials
    while bad - good[0] > unit:
        middle = (good[0] + bad) // 2 // unit * unit
        if middle <= good[0]:
            break
        trained = run(middle)
        good, bad = (trained, bad) if trained else (good, middle)
    return good, trials


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="*", default=["mlp", "gpt", "hf-gpt2"], choices=["mlp", "gpt", "hf-gpt2"])
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_zero3_capacity.py needs root and the cgroup memory controller")
    starts = {"mlp": (1024, 128), "gpt": (8, 1), "hf-gpt2": (8, 1)}
    rows = []
    for model in args.models:
        began = time.time()
        row = {"model": model, "limits_gib": LIMITS_GIB}
        for system in ("upstream", "fork"):
            good, trials = largest(system, model, *starts[model])
            row[system] = {"size": good[0] if good else None,
                           "parameters": good[1][0]["parameters"] if good else 0,
                           "peaks_mib": [r["peak_mib"] for r in good[1]] if good else None,
                           "shares": good[1][0]["shares"] if good else None, "trials": trials}
        row["ratio"] = row["fork"]["parameters"] / max(1, row["upstream"]["parameters"])
        row["seconds"] = round(time.time() - began)
        rows.append(row)
        print(f"{model}: upstream {row['upstream']['size']} ({row['upstream']['parameters'] / 1e6:.1f}M), fork "
              f"{row['fork']['size']} ({row['fork']['parameters'] / 1e6:.1f}M, shares {row['fork']['shares']}): "
              f"{row['ratio']:.2f}x the parameters (goal >= 1.5)", flush=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    # The other models' rows of an earlier run are kept: a run of some models replaces theirs only.
    kept = [row for row in (json.loads(RESULTS.read_text()) if RESULTS.exists() else [])
            if row["model"] not in args.models]
    RESULTS.write_text(json.dumps(kept + rows, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
