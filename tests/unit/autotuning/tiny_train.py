# SPDX-License-Identifier: Apache-2.0
"""A small training script for the autotuning tests, with switches that misbehave on purpose.

    deepspeed --autotuning tune --num_gpus 2 tiny_train.py --deepspeed_config ds_config.json

--ignore-deepspeed  trains without passing the ds_config to deepspeed.initialize (exits 0, no metrics)
--hang-at-step N    sleeps forever at step N (the per-experiment time-out must kill it)
--build-seconds S   before deepspeed.initialize, rank 0 "JIT-builds" an op of its own for S seconds:
                    it holds torch's build lock of op PREFIX_<hash of the config path> under
                    TORCH_EXTENSIONS_DIR (PREFIX from --build-op), as a real build does; each
                    experiment (each config path) builds once, and a killed build starts again
--oom-above N       raises MemoryError when a rank's micro-batch exceeds N samples
--print-error       writes lines containing "error" to stderr and still trains normally
--sleep-schedule    per forward call k, sleeps SCHEDULE[k % len] seconds (comma list)
--sleep-per-sample  sleeps S seconds per sample in the forward: compute that dominates, and that the
                    emulation's time dilation stretches like real compute
"""

import argparse
import hashlib
import os
import sys
import time

import torch

import deepspeed


class Net(torch.nn.Module):

    def __init__(self, sleeps=None, per_sample=0.0):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
        self.sleeps = sleeps
        self.per_sample = per_sample
        self.calls = 0

    def forward(self, x, y):
        if self.sleeps:
            time.sleep(self.sleeps[self.calls % len(self.sleeps)])
        self.calls += 1
        if self.per_sample:
            time.sleep(self.per_sample * len(x))
        return torch.nn.functional.mse_loss(self.layers(x), y)


class Data(torch.utils.data.Dataset):

    def __init__(self, size=4096):
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randn(size, 64, generator=generator)
        self.y = torch.randn(size, 64, generator=generator)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return self.x[index], self.y[index]


def build(args):
    from torch.utils.file_baton import FileBaton
    digest = hashlib.sha1(str(args.deepspeed_config).encode()).hexdigest()[:10]
    build_dir = os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], f"{args.build_op}_{digest}")
    os.makedirs(build_dir, exist_ok=True)
    if os.path.exists(os.path.join(build_dir, "built")):
        return
    baton = FileBaton(os.path.join(build_dir, "lock"))
    assert baton.try_acquire(), f"the build lock of {build_dir} is taken"
    print(f"building op {os.path.basename(build_dir)}", flush=True)
    time.sleep(args.build_seconds)
    open(os.path.join(build_dir, "built"), "w").close()
    baton.release()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--ignore-deepspeed", action="store_true")
    parser.add_argument("--hang-at-step", type=int, default=None)
    parser.add_argument("--build-seconds", type=float, default=0.0)
    parser.add_argument("--build-op", default="tiny_train_op")
    parser.add_argument("--oom-above", type=int, default=None)
    parser.add_argument("--print-error", action="store_true")
    parser.add_argument("--sleep-schedule", default=None)
    parser.add_argument("--sleep-per-sample", type=float, default=0.0)
    parser.add_argument("--batch", type=int, default=None, help="mapped by arg_mappings in a test")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.build_seconds and args.local_rank in (-1, 0):
        build(args)
    sleeps = [float(s) for s in args.sleep_schedule.split(",")] if args.sleep_schedule else None
    model = Net(sleeps, args.sleep_per_sample)
    if args.ignore_deepspeed:
        config = {"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.01}}}
        engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                    training_data=Data(), config=config)
    else:
        engine, _, loader, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(),
                                                    training_data=Data())
    if args.print_error:
        print("warning: no error here, just the word error", file=sys.stderr, flush=True)
    batches = iter(loader)
    for step in range(args.steps):
        if args.hang_at_step is not None and step == args.hang_at_step:
            print(f"rank {engine.global_rank} pid {os.getpid()} hanging", flush=True)
            time.sleep(3600)
        for _ in range(engine.gradient_accumulation_steps()):
            x, y = next(batches)
            if args.oom_above is not None and len(x) > args.oom_above:
                raise MemoryError(f"DefaultCPUAllocator: can't allocate memory for a micro-batch of {len(x)}")
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
    if engine.global_rank == 0:
        print(f"training finished after {args.steps} steps", flush=True)
    # Destroy the process group and leave without interpreter finalization, where gloo's worker
    # threads can abort a rank ("terminate called without an active exception") after its work.
    from deepspeed.runtime.heterogeneous.cli.process_exit import end_process
    end_process(0)


if __name__ == "__main__":
    main()
