# SPDX-License-Identifier: Apache-2.0
"""Faults around checkpoints under the deepspeed launcher, for
tests/unit/heterogeneous/test_checkpoint_faults.py. Two ranks, ZeRO-2 Adam, the heterogeneous plan
[6, 2] with memory shares [0.7, 0.3] (the config of tests/unit/scripts/elastic_train.py).

Cases (``--case``):

- ``kill-in-save``: steps 1-2, ``engine.save_checkpoint(<out>/explicit, tag="step2")``, steps 3-4,
  then ``save_checkpoint(tag="step4")``, during which global rank 1 writes the first half of its
  optimizer file and is killed (SIGKILL). Rank 0 writes the full fp32 parameters after steps 2 and 3
  to ``<out>/reference.pt``;
- ``load``: for each ``--load DIR[:TAG]`` in turn (no tag: the one ``latest`` names),
  ``engine.load_checkpoint``, then one step; rank 0 appends what it loaded (path, steps, full fp32
  parameters after the load and after the step) to ``<out>/loaded.pt`` before the next load;
- ``kill-in-step``: global rank 1 is killed as it enters the gradients' reduction of step 2, a
  collective its peer waits in.

Collectives time out after 60 s (``init_distributed``'s timeout).

    deepspeed --num_gpus 2 tests/unit/scripts/checkpoint_faults.py --out DIR --case kill-in-save
"""

import argparse
import datetime
import io
import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # elastic_train: the model, data and config
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/unit: references, which it imports
import elastic_train  # noqa: E402

WORLD = 2
KILLED_RANK = 1


def kill_while_writing(engine):
    """Make global rank ``KILLED_RANK`` die halfway through writing its ZeRO optimizer file: what
    reaches the disk is the first half of the file, as a process killed during a write leaves it."""
    if torch.distributed.get_rank() != KILLED_RANK:
        return
    save = engine.checkpoint_engine.save

    def torn_save(state_dict, path):
        if not str(path).endswith("optim_states.pt"):
            return save(state_dict, path)
        buffer = io.BytesIO()
        torch.save(state_dict, buffer)
        data = buffer.getvalue()
        with open(path, "wb") as stream:
            stream.write(data[:len(data) // 2])
            stream.flush()
            os.fsync(stream.fileno())
        # Rank 0 finishes its own files meanwhile, and whatever it writes after them ('latest', in
        # upstream's order) is on disk before this rank's death ends the job.
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)

    engine.checkpoint_engine.save = torn_save


def kill_in_reduction(engine, step):
    """Make global rank ``KILLED_RANK`` die as it enters the gradients' reduction of step ``step``."""
    if torch.distributed.get_rank() != KILLED_RANK:
        return
    import deepspeed.comm as ds_comm

    def dying(collective):

        def entered(*args, **kwargs):
            if engine.global_steps + 1 == step:
                os.kill(os.getpid(), signal.SIGKILL)
            return collective(*args, **kwargs)

        return entered

    ds_comm.reduce_scatter_fn = dying(ds_comm.reduce_scatter_fn)
    ds_comm.all_reduce = dying(ds_comm.all_reduce)


def full_parameters(engine):
    """The full fp32 parameters (a collective: every rank calls it)."""
    from deepspeed.utils import safe_get_full_fp32_param
    return [safe_get_full_fp32_param(p).clone() for p in engine.module.parameters()]


class Trainer:
    """Steps of the engine on its loader, one epoch after another; ``restart()`` after a load, whose
    samplers continue at the saved position."""

    def __init__(self, engine, loader):
        self.engine, self.loader, self.iterator = engine, loader, None

    def restart(self):
        self.iterator = None

    def to(self, steps):
        engine = self.engine
        if self.iterator is None:
            self.iterator = iter(self.loader)
        while engine.global_steps < steps:
            for _ in range(engine.gradient_accumulation_steps()):
                try:
                    inputs, targets = next(self.iterator)
                except StopIteration:
                    self.iterator = iter(self.loader)
                    inputs, targets = next(self.iterator)
                engine.backward(torch.nn.functional.mse_loss(engine(inputs), targets))
                engine.step()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--case", required=True, choices=["kill-in-save", "load", "kill-in-step"])
    parser.add_argument("--load", action="append", default=[], help="DIR or DIR:TAG (case load)")
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    import deepspeed
    from deepspeed.runtime.heterogeneous.process_exit import end_process

    deepspeed.init_distributed("gloo", timeout=datetime.timedelta(seconds=60))
    rank = torch.distributed.get_rank()
    data = elastic_train.samples()
    model = elastic_train.make_model()
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                config=elastic_train.config(WORLD, 2), training_data=data)
    trainer = Trainer(engine, loader)
    if args.case == "load":
        loaded = []
        for entry in args.load:
            folder, _, tag = entry.partition(":")
            path, _ = engine.load_checkpoint(folder, tag=tag or None)
            trainer.restart()
            record = {"path": path, "steps": engine.global_steps, "params": full_parameters(engine)}
            trainer.to(engine.global_steps + 1)
            record["params_after_step"] = full_parameters(engine)
            loaded.append(record)
            if rank == 0:
                torch.save(loaded, os.path.join(args.out, "loaded.pt"))
        end_process(0)
    if args.case == "kill-in-step":
        kill_in_reduction(engine, step=2)
        trainer.to(3)
        end_process(0)
    explicit = os.path.join(args.out, "explicit")
    trainer.to(2)
    engine.save_checkpoint(explicit, tag="step2")
    reference = {"step2": full_parameters(engine)}
    trainer.to(3)
    reference["step3"] = full_parameters(engine)
    if rank == 0:
        torch.save(reference, os.path.join(args.out, "reference.pt"))
    trainer.to(4)
    kill_while_writing(engine)
    engine.save_checkpoint(explicit, tag="step4")
    end_process(0)


if __name__ == "__main__":
    main()
