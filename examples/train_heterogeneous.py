# SPDX-License-Identifier: Apache-2.0
"""Train the small GPT on the generated corpus with a heterogeneous_config; for
examples/heterogeneous_demo.py, rank 0 prints JSON lines: the start-up plan and what it came from,
one line per step (its loss, the plan it ran, seconds since the first step began) and a summary
(samples/s from step 5 on, the emulation mode, the per-rank speeds the profiling steps measured).

    deepspeed --num_gpus 2 examples/train_heterogeneous.py --deepspeed_config ds_config.json --steps 40

With ``--profile DIR`` the heterogeneous profiler records every step from step 5 on and writes
``DIR/profile.json`` and ``DIR/timeline.png`` (the PNG needs matplotlib), and rank 0 prints its
report.
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deepspeed  # noqa: E402
from deepspeed import comm as dist  # noqa: E402
from examples.tiny_gpt import GPT, GPTConfig, TokenDataset, split_batch  # noqa: E402

MEASURE_FROM = 5  # steps before this one (start-up, profiling) are left out of samples/s


def startup(engine):
    """The start-up plan's micro-batches, the plan before any memory cap (``state.reference_plan``)
    and the devices' prior scores with their source ("spec", "measured"; "unknown" scores 0)."""
    state = engine._config.heterogeneous
    plan, planned = state.plan, state.reference_plan or state.plan
    devices = state.devices or []
    return {"plan": list(plan.micro_batch_sizes) if plan else None,
            "planned": list(planned.micro_batch_sizes) if planned else None,
            "scores": [d.spec_score for d in devices], "sources": [d.score_source for d in devices]}


def profiled_speeds(runtime):
    """Per data-parallel rank, the speed the profiling steps measured (forward+backward samples per
    second, ``profiling.measured_rates``) relative to rank 0's; None where nothing was profiled."""
    from deepspeed.runtime.heterogeneous.planning.profiling import measured_rates
    if runtime is None or not runtime.decisions.history:
        return None
    try:
        rates = measured_rates(runtime.decisions.history)
    except ValueError:  # a rank without micro-steps: nothing to report
        return None
    return [rates[0] / rate for rate in rates]


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--profile", metavar="DIR", help="profile from step 5 on; JSON and PNG timeline into DIR")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    torch.set_num_threads(1)  # one core per rank: the emulated devices must not share cores
    model = GPT(GPTConfig.demo(), seed=0)
    dataset = TokenDataset(seq_len=model.config.seq_len, num_samples=8192, seed=0)
    engine, _, loader, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(),
                                                training_data=dataset)
    rank = engine.global_rank
    if rank == 0:
        print(json.dumps({"start": startup(engine)}), flush=True)
    batches = iter(loader)
    start = profiler = None
    began = time.perf_counter()
    for step in range(args.steps):
        if step == MEASURE_FROM:
            dist.barrier()
            start = time.perf_counter()
            if args.profile:
                from deepspeed.profiling.heterogeneous_profiler import HeterogeneousProfiler
                profiler = HeterogeneousProfiler(engine)
                profiler.start_heterogeneous_profile()
        ran = engine.heterogeneous_plan  # the plan this step runs (profiling may switch it at the step's end)
        inputs, targets = split_batch(next(batches).to(engine.device))
        loss = engine(inputs, targets)
        engine.backward(loss)
        engine.step()
        # The global batch's loss: every rank's mean weighted by its share of the samples.
        # On the engine's device: NCCL reduces device tensors only.
        share = torch.tensor([loss.item() * len(inputs), float(len(inputs))], device=engine.device)
        dist.all_reduce(share)
        if rank == 0:
            print(json.dumps({"step": step, "loss": share[0].item() / share[1].item(),
                              "plan": list(ran.micro_batch_sizes) if ran else None,
                              "elapsed": time.perf_counter() - began}), flush=True)
    dist.barrier()
    elapsed = time.perf_counter() - start
    if profiler is not None:
        profiler.stop_profile()
        profiler.print_heterogeneous_metrics()
        if rank == 0:
            os.makedirs(args.profile, exist_ok=True)
            profiler.export_json(os.path.join(args.profile, "profile.json"))
            try:
                profiler.save_timeline(os.path.join(args.profile, "timeline.png"))
            except ImportError as exc:
                print(f"no timeline: {exc}", flush=True)
    runtime = engine._heterogeneous_runtime()
    modes = [None] * dist.get_world_size()
    dist.all_gather_object(modes, runtime.emulation_mode if runtime else "none")
    if rank == 0:
        samples = engine.train_batch_size() * (args.steps - MEASURE_FROM)
        print(json.dumps({"summary": True, "samples_per_s": samples / elapsed,
                          "emulation": "/".join(sorted(set(modes) - {"none"})) or "none",
                          "measured_speeds": profiled_speeds(runtime)}), flush=True)
    engine.destroy()  # what the fork started for the engine ends before the process groups go
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
