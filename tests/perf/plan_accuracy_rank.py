# SPDX-License-Identifier: Apache-2.0
"""One rank of ``bench_plan_accuracy.py``: the configuration a plan predicted, run and measured.

Started by the real ``deepspeed`` launcher on every host of an emulated cluster
(``scripts/emulated_cluster.py``), with ``--spec``: a JSON file the benchmark wrote (the ds_config to
run, the model, the steps, each rank's memory limit). The rank:

1. sets one torch thread, starts the process group, imports what the engine imports on first use
   and fixes the host allocator's mmap threshold (``memory/meter.py``: freed tensors go back to the
   kernel, as a device's memory goes back to its pool), and builds its batches;
2. joins a memory cgroup of its own (``emulation.emulator.MemoryLimitCgroup``, limited to the rank's
   memory in the cluster description), so that from here on everything the run allocates is counted
   there: the model's parameters (built after joining, as on an empty device), the engine's buffers,
   the optimizer state and the activations, and nothing of the interpreter, torch or the process
   group, which a device would not hold either;
3. builds the model and the engine and trains: warm-up steps, then ``short`` and ``long`` steps
   between three marks (``comm_train.mark``: every rank stops while the benchmark reads the link's
   ``tc`` counters), recording the time at which each step ended;
4. writes ``<out>/rank<R>.json``: the step ends, the cgroup's peak (``memory.max_usage_in_bytes`` /
   ``memory.peak``) and what it held when joined, the plan and shares the engine ran, the losses.

Kinds: ``zero`` (examples/tiny_gpt's GPT at the spec's size, data parallel) and ``pipeline``
(12 residual MLP blocks, bench_pipeline.py's shape, in a ``PipelineModule`` of one stage per rank,
built from ``LayerSpec`` so that each stage holds only its own layers).
"""

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE.parents[1] / "tests" / "unit"), str(HERE)]

import torch  # noqa: E402

from comm_train import mark  # noqa: E402


def cgroup_bytes(path):
    """(in use, peak) of the memory cgroup at ``path`` (v1 or v2 file names)."""
    def read(*names):
        for name in names:
            file = Path(path) / name
            if file.exists():
                return int(file.read_text().split()[0])
        return None

    return read("memory.usage_in_bytes", "memory.current"), read("memory.max_usage_in_bytes", "memory.peak")


def gpt_batches(spec, rank, steps):
    """This rank's micro-batches for ``steps`` steps: of each global micro-batch its contiguous
    ``micro_batch_sizes[rank]`` samples, as the fork's sampler takes them."""
    from examples.tiny_gpt import TokenDataset, split_batch
    sizes = spec["micro_batch_sizes"]
    gas = spec["ds_config"]["gradient_accumulation_steps"]
    per_micro = sum(sizes)
    data = TokenDataset(seq_len=spec["model"]["seq_len"], num_samples=steps * gas * per_micro, seed=0)
    start = sum(sizes[:rank])
    batches = []
    for micro in range(steps * gas):
        first = micro * per_micro + start
        batches.append(split_batch(torch.stack([data[i] for i in range(first, first + sizes[rank])])))
    return batches


WIDTH, HIDDEN, BLOCKS = 256, 1024, 12
"""The pipeline's residual MLP blocks (bench_pipeline.py's shape)."""


class Block(torch.nn.Module):
    """``x + down(gelu(up(norm(x))))``: one layer of the pipeline rows."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.up = torch.nn.Linear(WIDTH, HIDDEN)
        self.down = torch.nn.Linear(HIDDEN, WIDTH)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def pipeline_data(spec, steps):
    samples = spec["ds_config"]["train_batch_size"] * (steps + 1)
    generator = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(samples, WIDTH, generator=generator),
                                          torch.randn(samples, WIDTH, generator=generator))


def clocks():
    """(wall, seconds in collectives, seconds slept by dilation, this thread's CPU time, its waits for
    a core) so far."""
    from deepspeed.runtime.heterogeneous.measure import comm_clock
    return (time.perf_counter(), comm_clock.seconds_in_collectives(), comm_clock.seconds_dilated, time.thread_time(),
            comm_clock.run_queue_seconds() or 0.0)


CLOCK_NAMES = ("wall_s", "collectives_s", "dilation_slept_s", "thread_cpu_s", "run_queue_s")


class PhasePeaks:
    """Per phase of the timed steps (forward, backward, step; a pipeline's instructions), the memory
    cgroup's peak, read and reset at each phase's end (v1 ``memory.max_usage_in_bytes`` takes a
    reset; elsewhere nothing is read), and the clocks' time spent in it (``clocks``): which phase the
    measured peak is in, and where a step's time goes."""

    def __init__(self):
        self.path, self.peaks, self.seconds, self.last = None, {}, {}, None

    def start(self, path):
        reset = Path(path) / "memory.max_usage_in_bytes"
        if reset.exists():
            self.path, self.before = reset, int(reset.read_text())
            reset.write_text("0")
        self.last = clocks()

    def end(self, phase):
        if self.path is not None:
            self.peaks[phase] = max(self.peaks.get(phase, 0), int(self.path.read_text()))
            self.path.write_text("0")
        if self.last is not None:
            now = clocks()
            spent = self.seconds.setdefault(phase, [0.0] * len(now))
            for i, (a, b) in enumerate(zip(self.last, now)):
                spent[i] += b - a
            self.last = now

    def resume(self):
        """Time from here on counts (marks and waits between steps do not)."""
        if self.last is not None:
            self.last = clocks()


PHASES = PhasePeaks()
PIPELINE_PHASES = {"ForwardPass": "forward", "BackwardPass": "backward", "ReduceGrads": "reduce",
                   "OptimizerStep": "step", "LoadMicroBatch": "load"}


def _phase_end(function, phase):
    """A pipeline instruction that ends a phase of ``PHASES`` (the engine's instruction map, per engine)."""

    def run(self, *args, **kwargs):
        result = function(self, *args, **kwargs)
        PHASES.end(phase)
        return result

    return run


def build(spec, rank, steps):
    """``(engine, step)``: ``step()`` trains one optimizer step and returns its loss."""
    import deepspeed
    config = spec["ds_config"]
    if spec["kind"] == "pipeline":
        from deepspeed.pipe import LayerSpec, PipelineModule
        torch.manual_seed(0)
        data = spec["_data"]
        # LayerSpec: each stage builds only its own layers, as the engine starts.
        net = PipelineModule(layers=[LayerSpec(Block) for _ in range(BLOCKS)], num_stages=spec["world_size"],
                             loss_fn=torch.nn.MSELoss(), partition_method="heterogeneous")
        engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=[p for p in net.parameters()],
                                               config=config, training_data=data)
        engine._INSTRUCTION_MAP = {kind: _phase_end(function, PIPELINE_PHASES.get(kind.__name__, "transfer"))
                                   for kind, function in engine._INSTRUCTION_MAP.items()}
        return engine, lambda: float(engine.train_batch())
    from examples.tiny_gpt import GPT, GPTConfig
    model = GPT(GPTConfig(**spec["model"]), seed=0)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    batches = iter(spec["_batches"])

    def step():
        total = 0.0
        for _ in range(engine.gradient_accumulation_steps()):
            inputs, targets = next(batches)
            loss = engine(inputs, targets)
            PHASES.end("forward")
            engine.backward(loss)
            PHASES.end("backward")
            engine.step()
            PHASES.end("step")
            total += float(loss)
        return total / engine.gradient_accumulation_steps()

    return engine, step


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spec", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    spec = json.loads(args.spec.read_text())

    torch.set_num_threads(1)
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.runtime.heterogeneous.emulation.emulator import MemoryLimitCgroup
    from deepspeed.runtime.heterogeneous.memory.meter import fix_host_allocator_threshold, load_engine_modules

    deepspeed.init_distributed()
    rank = dist.get_rank()
    load_engine_modules()
    fix_host_allocator_threshold()
    warmup, short, long = spec["warmup"], spec["short"], spec["long"]
    steps = warmup + short + long
    if spec["kind"] == "zero":
        spec["_batches"] = gpt_batches(spec, rank, steps)
    else:
        import deepspeed.pipe  # noqa: F401 -- imported before the cgroup: the interpreter's, not the run's
        spec["_data"] = pipeline_data(spec, steps)  # the loader's samples: host memory, not the device's

    cgroup = MemoryLimitCgroup(int(spec["memory_limit_bytes"][rank]), label=f"planacc-rank{rank}")
    joined, _ = cgroup_bytes(cgroup.path)
    engine, step = build(spec, rank, steps)
    after_start, _ = cgroup_bytes(cgroup.path)
    from deepspeed.runtime.heterogeneous.measure import comm_clock
    losses, ends, parts = [], [], []
    for _ in range(warmup):
        losses.append(step())
    mark(args.out, "a")
    PHASES.start(cgroup.path)
    comm_clock.enable()  # the breakdown below: seconds inside collectives (waits for peers included)

    for index in range(short + long):
        if index == short:
            mark(args.out, "b")
        PHASES.resume()
        before = clocks()
        losses.append(step())
        ends.append(time.perf_counter())
        parts.append([b - a for a, b in zip(before, clocks())])
    dist.barrier()
    ends.append(time.perf_counter())
    mark(args.out, "c")
    usage, peak = cgroup_bytes(cgroup.path)
    if PHASES.path is not None:  # the peak was reset at every phase: the largest of them and of before
        peak = max([PHASES.before, peak] + list(PHASES.peaks.values()))
    plan = engine.heterogeneous_plan
    state = engine._config.heterogeneous
    shares = state.partition_shares
    result = {
        "rank": rank, "step_ends": ends[:-1],
        "step_parts": {"names": list(CLOCK_NAMES), "steps": parts},
        "phase_seconds": {phase: dict(zip(CLOCK_NAMES, [v / (short + long) for v in spent]))
                          for phase, spent in PHASES.seconds.items()},
        "segment_end": ends[-1], "short": short, "long": long,
        "joined_bytes": joined, "after_start_bytes": after_start, "peak_bytes": peak, "usage_bytes": usage,
        "losses": losses,
        "phase_peaks": PHASES.peaks, "peak_before_timed_steps": getattr(PHASES, "before", None),
        "micro_batch_sizes": list(plan.micro_batch_sizes) if plan is not None else None,
        "partition_shares": None if shares is None else [float(s) for s in shares],
        "parts": [int(p) for p in engine.module.parts] if spec["kind"] == "pipeline" else None,
        "emulation_mode": getattr(engine._heterogeneous_runtime(), "emulation_mode", None)
        if hasattr(engine, "_heterogeneous_runtime") else None,
    }
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))
    engine.destroy()
    cgroup.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
