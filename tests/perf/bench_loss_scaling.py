# SPDX-License-Identifier: Apache-2.0
"""Adaptive fp16 loss scaling vs upstream's dynamic scaler, with an fp32 run as the reference.

Why: a loss scale that is too high overflows, and the step is skipped (compute and data spent
for nothing); one that is too low lets small gradients round to zero in fp16. Upstream's dynamic
scaler probes upwards every ``loss_scale_window`` clean steps and pays for each probe that
overflows with skipped steps (two per failed probe with the default hysteresis 2); the adaptive
scaler (``fp16.auto_scale_threshold``) picks the scale from the measured gradient max-abs instead.

Workload: the project's small GPT (examples/tiny_gpt) at a size that trains a few hundred steps
in fp16 within minutes on two cores: d_model 64, 2 layers, 4 heads, seq_len 64 (0.12 M
parameters), global batch 16, AdamW lr 1e-3, ZeRO stage 1, one rank on DeepSpeed's CPU
accelerator (gloo). Three runs with the same initial weights and the same batches, in one process:

- ``fp32``: no fp16 block, the accuracy reference;
- ``dynamic``: upstream's scaler, ``fp16.enabled`` with the defaults (initial_scale_power 16,
  hysteresis 2, min_loss_scale 1) except ``loss_scale_window`` (``--loss-scale-window``, default
  50, so that the scale grows, and probes, several times within the run);
- ``adaptive``: the same fp16 block plus ``auto_scale_threshold`` 0.95.

Measured per run:

- skipped steps: steps on which ``engine.skipped_steps`` grew (overflows); the JSON lists them.
  Target: adaptive <= 20% of dynamic.
- loss scale: the scale each step's backward used, min and max over the run, and the final
  scale after the last update; the JSON lists every change.
- gradient underflow: at every ``--sample-every``-th step (0, k, 2k, ...), before that step's
  backward, an fp32 twin of the model loaded with the run's current weights (the fp16 values,
  exactly representable in fp32) computes the true gradient of the step's batch in fp32. Over
  every parameter gradient element ``g`` with ``g != 0``, the underflow fraction is the share
  for which ``float16(g * scale) == 0``, ``scale`` being the loss scale of that step's backward;
  counts are pooled over the sampled steps (underflowing elements / non-zero elements). For the
  fp32 run the scale is 1: what fp16 without loss scaling would lose. Measured the same way for
  both scalers. It counts losses where gradients are stored (the parameters' gradients); small
  activation gradients lost inside the backward pass show only through the final loss.
- final loss: the mean training loss of the last ``--final-steps`` steps (default 20; every run
  sees the same batches there). Target: adaptive within 1% of dynamic. The ratio of each fp16
  run to fp32 is reported without a target.

fp16 on the CPU accelerator: DeepSpeed refuses fp16 where the accelerator reports no support,
which the CPU accelerator does when oneDNN has no fp16 kernels. By default the benchmark then
lets fp16 run on torch's own CPU kernels (slower; fp16 storage and range, hence overflow and
underflow, are those of any fp16 device, though accumulation inside kernels may differ) and
says so in its output; ``--no-torch-fp16-kernels`` skips instead (exit 0, one line).

Absolute times on a shared machine are noise; the skipped-step and loss ratios come from one run.

    python tests/perf/bench_loss_scaling.py            # from the repository root, ~10 min on 2 cores
    python tests/perf/bench_loss_scaling.py --quick    # a smoke test in seconds, no JSON
"""

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "unit")]

from examples.tiny_gpt import GPTConfig  # noqa: E402
from harness import run_ranks  # noqa: E402

RUNS = ("fp32", "dynamic", "adaptive")
AUTO_SCALE_THRESHOLD = 0.95
TARGET_SKIPPED_FRACTION = 0.20  # adaptive's skipped steps as a share of dynamic's, at most
TARGET_FINAL_LOSS_DEVIATION = 0.01  # |adaptive / dynamic - 1|, at most
RESULTS = REPO / "tests" / "perf" / "results" / "loss_scaling.json"


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything the three runs share; picklable, it travels to the spawned rank."""

    model: GPTConfig
    global_batch: int
    steps: int
    loss_scale_window: int
    sample_every: int
    final_steps: int
    torch_fp16_kernels: bool
    lr: float = 1e-3

    def __post_init__(self):
        for name in ("global_batch", "steps", "loss_scale_window", "sample_every", "final_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.final_steps > self.steps:
            raise ValueError(f"final_steps ({self.final_steps}) exceeds steps ({self.steps})")


FULL_MODEL = GPTConfig(seq_len=64, n_layer=2, n_head=4, d_model=64)
QUICK = dict(model=GPTConfig(seq_len=16, n_layer=1, n_head=2, d_model=32), global_batch=4, steps=10,
             loss_scale_window=4, sample_every=5, final_steps=5)


def ds_config(run, settings):
    config = {
        "train_batch_size": settings.global_batch,
        "steps_per_print": 10**6,
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": settings.lr, "torch_adam": True}},
    }
    if run != "fp32":
        # initial_scale_power and hysteresis are upstream's defaults, written out so that the report states them.
        config["fp16"] = {"enabled": True, "initial_scale_power": 16, "hysteresis": 2,
                          "loss_scale_window": settings.loss_scale_window}
        if run == "adaptive":
            config["fp16"]["auto_scale_threshold"] = AUTO_SCALE_THRESHOLD
    return config


def enable_fp16(torch_fp16_kernels):
    """How this rank runs fp16: 'accelerator', 'torch' (the CPU accelerator reports no fp16 and
    torch's own kernels stand in), or None (unsupported and not allowed: skip)."""
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    if accelerator.is_fp16_supported():
        return "accelerator"
    if not (torch_fp16_kernels and accelerator.device_name() == "cpu"):
        return None
    # DeepSpeed asks the accelerator (a process-wide singleton) before it runs fp16; torch's own CPU
    # kernels compute every op these models use in fp16, only slower than oneDNN's would.
    accelerator.is_fp16_supported = lambda: True
    return "torch"


def gradient_underflow(twin, module, inputs, targets, scale):
    """(elements of the true gradient that are non-zero but zero in fp16 once scaled, non-zero ones).

    ``twin`` is an fp32 model of the same shape; it takes ``module``'s current weights."""
    import torch
    twin.load_state_dict(module.state_dict())
    twin.zero_grad(set_to_none=True)
    twin(inputs, targets).backward()
    underflowed = nonzero = 0
    for param in twin.parameters():
        grad = param.grad
        present = grad != 0
        underflowed += int(((grad * scale).to(torch.float16) == 0).logical_and_(present).sum())
        nonzero += int(present.sum())
    return underflowed, nonzero


def train(run, settings):
    """One run; returns per-step losses and scales, underflow samples and skipped steps."""
    import torch
    import deepspeed
    from examples.tiny_gpt import GPT, TokenDataset, split_batch

    model = GPT(settings.model, seed=0)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config(run, settings))
    twin = GPT(settings.model, seed=0)
    dataset = TokenDataset(seq_len=settings.model.seq_len, num_samples=settings.steps * settings.global_batch, seed=0)
    scaler = engine.optimizer.loss_scaler
    losses, scales, samples, skipped_at = [], [], [], []
    start = time.perf_counter()
    for step in range(settings.steps):
        first = step * settings.global_batch
        inputs, targets = split_batch(torch.stack([dataset[i] for i in range(first, first + settings.global_batch)]))
        scale = float(scaler.cur_scale)  # the scale this step's backward multiplies the loss by
        if step % settings.sample_every == 0:
            underflowed, nonzero = gradient_underflow(twin, engine.module, inputs, targets, scale)
            samples.append({"step": step, "scale": scale, "underflowed": underflowed, "nonzero": nonzero})
        loss = engine(inputs, targets)
        engine.backward(loss)
        skipped_before = engine.skipped_steps
        engine.step()
        if engine.skipped_steps > skipped_before:
            skipped_at.append(step)
        losses.append(loss.item())
        scales.append(scale)
    return {"run": run, "scaler": type(scaler).__name__, "skipped_at": skipped_at, "losses": losses,
            "scales": scales, "final_scale": float(scaler.cur_scale), "underflow_samples": samples,
            "wall_s": time.perf_counter() - start, "parameters": model.num_parameters()}


def _rank_main(rank, world_size, settings):
    import torch
    fp16_kernels = enable_fp16(settings.torch_fp16_kernels)
    if fp16_kernels is None:
        return {"fp16_kernels": None}
    return {"fp16_kernels": fp16_kernels, "torch_threads": torch.get_num_threads(),
            "runs": [train(run, settings) for run in RUNS]}


def summarize(result, settings):
    samples = result["underflow_samples"]
    changes = [[0, result["scales"][0]]]
    for step, scale in enumerate(result["scales"][1:] + [result["final_scale"]], start=1):
        if scale != changes[-1][1]:
            changes.append([step, scale])
    return {
        "scaler": result["scaler"], "skipped_steps": len(result["skipped_at"]), "skipped_at": result["skipped_at"],
        "scale_min": min(result["scales"]), "scale_max": max(result["scales"]), "scale_final": result["final_scale"],
        "scale_changes": changes,  # [step from which it applies, scale]; step == steps: after the run
        "underflow_fraction": sum(s["underflowed"] for s in samples) / max(1, sum(s["nonzero"] for s in samples)),
        "underflow_samples": samples,
        "final_loss": sum(result["losses"][-settings.final_steps:]) / settings.final_steps,
        "losses": result["losses"], "wall_s": result["wall_s"]
    }


def run(settings, output, quick):
    started = time.perf_counter()
    outcome = run_ranks(_rank_main, world_size=1, timeout=300 + 10 * settings.steps, args=(settings, ))[0]
    if outcome["fp16_kernels"] is None:
        print("fp16: the CPU accelerator reports no fp16 support (oneDNN has no fp16 kernels here); skipped "
              "(--torch-fp16-kernels runs it on torch's own CPU kernels)")
        return None
    runs = {result["run"]: summarize(result, settings) for result in outcome["runs"]}
    fp32, dynamic, adaptive = (runs[name] for name in RUNS)
    for name in RUNS:
        runs[name]["final_loss_vs_fp32"] = runs[name]["final_loss"] / fp32["final_loss"]
    loss_ratio = adaptive["final_loss"] / dynamic["final_loss"]
    report = {
        "workload": (f"tiny GPT (seq {settings.model.seq_len}, d_model {settings.model.d_model}, "
                     f"{settings.model.n_layer} layers, {outcome['runs'][0]['parameters']} parameters), "
                     f"global batch {settings.global_batch}, AdamW lr {settings.lr}, ZeRO 1, 1 rank, "
                     f"{outcome['torch_threads']} torch threads"),
        "quick": quick, "model": dataclasses.asdict(settings.model), "global_batch": settings.global_batch,
        "steps": settings.steps, "lr": settings.lr, "zero_stage": 1, "ranks": 1,
        "torch_threads": outcome["torch_threads"], "fp16_kernels": outcome["fp16_kernels"],
        "ds_configs": {name: ds_config(name, settings) for name in RUNS},
        "underflow_sample_every": settings.sample_every, "final_loss_steps": settings.final_steps,
        "targets": {"skipped_adaptive_over_dynamic_at_most": TARGET_SKIPPED_FRACTION,
                    "final_loss_adaptive_over_dynamic_deviation_at_most": TARGET_FINAL_LOSS_DEVIATION},
        "final_loss_adaptive_over_dynamic": loss_ratio,
        "meets_targets": {
            "skipped_steps": adaptive["skipped_steps"] <= TARGET_SKIPPED_FRACTION * dynamic["skipped_steps"],
            "final_loss": abs(loss_ratio - 1) <= TARGET_FINAL_LOSS_DEVIATION
        },
        "runs": runs, "wall_s": time.perf_counter() - started
    }
    print_table(report)
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(report, indent=2))
        print(f"JSON written to {os.path.relpath(output, REPO)}")
    return report


def format_scale(scale):
    mantissa, exponent = math.frexp(scale)
    return f"2^{exponent - 1}" if mantissa == 0.5 and scale != 1 else f"{scale:g}"


def print_table(report):
    kernels = {"accelerator": "the accelerator's fp16 kernels",
               "torch": "torch's CPU fp16 kernels (the CPU accelerator reports no fp16 support)"}
    print(f"\nloss scaling{' (--quick: a smoke test, targets not meaningful)' if report['quick'] else ''}: "
          f"{report['workload']}, {report['steps']} steps")
    fp16 = report["ds_configs"]["adaptive"]["fp16"]
    print(f"fp16 on {kernels[report['fp16_kernels']]}; both fp16 runs: initial scale 2^{fp16['initial_scale_power']}, "
          f"hysteresis {fp16['hysteresis']}, loss_scale_window {fp16['loss_scale_window']}; adaptive: "
          f"auto_scale_threshold {fp16['auto_scale_threshold']}")
    print(f"underflow sampled every {report['underflow_sample_every']} steps; final loss = mean of the last "
          f"{report['final_loss_steps']} steps; took {report['wall_s']:.0f} s")
    print(f"{'run':>8}  {'skipped':>7}  {'scale min':>9}  {'max':>6}  {'final':>6}  {'underflow':>9}  "
          f"{'final loss':>10}  {'vs fp32':>7}  {'time s':>6}")
    for name, row in report["runs"].items():
        scales = [format_scale(row[key]) for key in ("scale_min", "scale_max", "scale_final")]
        print(f"{name:>8}  {row['skipped_steps']:>7}  {scales[0]:>9}  {scales[1]:>6}  {scales[2]:>6}  "
              f"{row['underflow_fraction']:>9.3%}  {row['final_loss']:>10.4f}  "
              f"{row['final_loss_vs_fp32']:>7.4f}  {row['wall_s']:>6.0f}")
    print("(fp32 underflow: at scale 1, what fp16 without loss scaling would lose)")
    runs, met = report["runs"], report["meets_targets"]
    skipped = (runs["adaptive"]["skipped_steps"], runs["dynamic"]["skipped_steps"])
    share = f" ({skipped[0] / skipped[1]:.0%})" if skipped[1] else ""
    print(f"target: adaptive skipped <= {TARGET_SKIPPED_FRACTION:.0%} of dynamic's: {skipped[0]} vs {skipped[1]}"
          f"{share}  {'met' if met['skipped_steps'] else 'MISSED'}")
    print(f"target: adaptive final loss within {TARGET_FINAL_LOSS_DEVIATION:.0%} of dynamic's: ratio "
          f"{report['final_loss_adaptive_over_dynamic']:.4f}  {'met' if met['final_loss'] else 'MISSED'}")


def settings_from(args):
    if args.quick:
        return Settings(**QUICK, torch_fp16_kernels=args.torch_fp16_kernels)
    return Settings(model=FULL_MODEL, global_batch=args.batch, steps=args.steps,
                    loss_scale_window=args.loss_scale_window, sample_every=args.sample_every,
                    final_steps=args.final_steps, torch_fp16_kernels=args.torch_fp16_kernels)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="training steps per run (default 300)")
    parser.add_argument("--batch", type=int, default=16, help="global batch in sequences (default 16)")
    parser.add_argument("--loss-scale-window", type=int, default=50,
                        help="fp16.loss_scale_window of both fp16 runs (default 50)")
    parser.add_argument("--sample-every", type=int, default=10,
                        help="measure gradient underflow every this many steps (default 10)")
    parser.add_argument("--final-steps", type=int, default=20,
                        help="the final loss is the mean over this many last steps (default 20)")
    parser.add_argument("--torch-fp16-kernels", action=argparse.BooleanOptionalAction, default=True,
                        help="where the CPU accelerator reports no fp16 support, run fp16 on torch's own CPU kernels "
                        "(default); with --no-torch-fp16-kernels the benchmark skips there")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny model (seq 16, d_model 32, 1 layer), batch 4, 10 steps, loss_scale_window 4, "
                        "to smoke-test the script; ignores the size options and writes JSON only to an explicit "
                        "--output")
    parser.add_argument("--output", type=Path, default=None, help=f"JSON path (default {RESULTS.relative_to(REPO)})")
    args = parser.parse_args()
    try:
        settings = settings_from(args)
    except ValueError as error:
        parser.error(str(error))
    output = args.output if args.output is not None or args.quick else RESULTS
    os.chdir(REPO)
    run(settings, output, args.quick)
