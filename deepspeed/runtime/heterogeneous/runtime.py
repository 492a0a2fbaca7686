# SPDX-License-Identifier: Apache-2.0
"""The fork's per-engine state while training: timing, profiling, re-planning, emulation.

The engine calls three hooks (all no-ops when heterogeneous mode is off):

- ``micro_step_begin`` at forward, ``micro_step_end`` after backward: this rank's compute time for
  its current micro-batch size (the device is synchronised at both ends, so it is the real time);
  an emulated slow rank is slowed here;
- ``step_end`` after the optimizer step: during the ``profile_steps`` first steps, the ranks pool
  their measurements, rank 0 fits ``time = a_i + b_i * mbs`` per rank and plans, the plan is
  broadcast, and every rank switches to it at this same step boundary (the sampler follows).

Any allocation gives the exact global-batch gradient (loss weighting), so profiling trains for
real: the steps spent measuring are ordinary training steps.
"""

import time

from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import logger

from . import comm_clock
from .batch import apply_plan
from .emulation import start_emulation
from .planner import Plan, fit_time_model, plan_micro_batches


class PlanAgreementError(RuntimeError):
    """A peer failed while the ranks were agreeing on a plan."""


class HeterogeneousRuntime:

    def __init__(self, engine):
        self.engine = engine
        self.config = engine._config
        self.settings = self.config.heterogeneous.config
        self.rank = self.config.heterogeneous_dp_rank
        self.group = engine.mpu.get_data_parallel_group() if engine.mpu is not None else None
        self.emulator = start_emulation(self.settings.emulation, self.rank)
        self.steps = 0
        self.profiling = self.settings.load_balancing_strategy == "compute_aware" and self.settings.profile_steps > 0
        self.history = []  # per finished step: every rank's [(mbs, seconds), ...]
        self._current = []
        self._began = None
        self.loaders = []
        self.log_plan("plan at start-up", self.plan)

    @property
    def plan(self):
        return self.config.heterogeneous_plan

    @property
    def emulation_mode(self):
        return self.emulator.mode if self.emulator is not None else "none"

    def log_plan(self, title, plan):
        if self.rank == 0:
            names = [d.name for d in self.config.heterogeneous_devices or []] or None
            logger.info(f"deepspeed-hetero {title} (strategy {plan.strategy}):\n{plan.format_table(names)}")

    # -- hooks --------------------------------------------------------------------------------

    @property
    def timing(self):
        """Micro-steps are timed (with a device synchronisation at both ends) only while profiling or
        when time dilation needs the compute time; otherwise the hooks cost nothing."""
        return self.profiling or (self.emulator is not None and self.emulator.mode == "dilation")

    def micro_step_begin(self):
        if not self.timing:
            return
        get_accelerator().synchronize()
        self._began = (time.perf_counter(), comm_clock.seconds_in_collectives())

    def micro_step_end(self):
        """This rank's own time for the micro-step: wall time minus time inside collectives, where
        a fast rank waits for slower peers."""
        if self._began is None:  # backward without forward through the engine
            return
        get_accelerator().synchronize()
        began, in_collectives = self._began

        def own_time():
            return time.perf_counter() - began - (comm_clock.seconds_in_collectives() - in_collectives)

        if self.emulator is not None:
            self.emulator.after_compute(own_time())
        # Measured after the emulated slow-down: the planner must see the slowed device.
        self._current.append((self.config.train_micro_batch_size_per_gpu, max(own_time(), 1e-9)))
        self._began = None

    def step_end(self):
        self.steps += 1
        mine, self._current = self._current, []
        if not self.profiling:
            return
        everyone = self._gather(mine)
        self.history.append(everyone)
        new_plan = self._agree(self._replan() if self.rank == 0 else None)
        if new_plan.micro_batch_sizes != self.plan.micro_batch_sizes:
            self.switch_to(new_plan, f"plan after profiling step {self.steps}")
        if self.steps >= self.settings.profile_steps:
            self.profiling = False

    # -- planning -----------------------------------------------------------------------------

    def measured_time_models(self):
        """Per-rank fits; the first step is left out once later ones exist (it carries warm-up)."""
        steps = self._fit_steps()
        return [fit_time_model([sample for step in steps for sample in step[rank]]) for rank in range(len(steps[0]))]

    def _fit_steps(self):
        return self.history[1:] if len(self.history) > 1 else self.history

    def _replan(self):
        # Gas stays as it is: the engine counts micro-steps to find the accumulation boundary, so
        # only micro-batch sizes may change mid-training (per-rank gas is a start-up decision).
        plan = self.plan
        if plan.per_rank_gas:
            return plan
        models = self.measured_time_models()
        gas = plan.gradient_accumulation_steps[0]
        best = plan_micro_batches(models, train_batch_size=plan.train_batch_size, gradient_accumulation_steps=gas,
                                  strategy="compute_aware")
        if self.steps >= self.settings.profile_steps:
            return best
        # Fitting a + b * mbs needs two sizes per rank; a rank timed at one size only so far trades
        # one sample with its neighbour for the next profiling step (any split is exact).
        sizes, seen = list(best.micro_batch_sizes), self._sizes_seen()
        for left in range(0, len(sizes) - 1, 2):
            pair = (left, left + 1)
            if all(len(seen[r] | {sizes[r]}) > 1 for r in pair):
                continue
            big, small = sorted(pair, key=lambda r: (-sizes[r], r))
            if sizes[big] > 1:
                sizes[big] -= 1
                sizes[small] += 1
        if sizes == list(best.micro_batch_sizes):
            return best
        return plan_micro_batches(models, train_batch_size=plan.train_batch_size, gradient_accumulation_steps=gas,
                                  strategy="manual", manual=sizes)

    def _sizes_seen(self):
        """Sizes each rank was timed at in the steps the fit uses (the warm-up step is not one)."""
        steps = self.history[1:]
        return [{size for step in steps for size, _ in step[rank]} for rank in range(self.plan.world_size)]

    def switch_to(self, plan, reason):
        """Adopt ``plan`` from the next step on (every rank calls this at the same boundary)."""
        old = self.plan
        apply_plan(self.config, plan)
        gas = list(plan.gradient_accumulation_steps) if plan.per_rank_gas else None
        for sampler in self.loaders:
            sampler.set_micro_batch_sizes(list(plan.micro_batch_sizes), gradient_accumulation_steps=gas)
        if self.rank == 0:
            logger.info(f"deepspeed-hetero {reason}: micro-batches {list(old.micro_batch_sizes)} -> "
                        f"{list(plan.micro_batch_sizes)}, predicted step time {old.predicted_step_time:.4g} s -> "
                        f"{plan.predicted_step_time:.4g} s")
            self.log_plan(reason, plan)

    # -- collectives (the edges) --------------------------------------------------------------

    def _gather(self, samples):
        world = dist.get_world_size(group=self.group)
        gathered = [None] * world
        try:
            dist.all_gather_object(gathered, samples, group=self.group)
        except Exception as exc:
            raise PlanAgreementError(f"deepspeed-hetero: data-parallel rank {self.rank} could not gather the "
                                     f"profiling measurements; a peer rank failed or timed out ({exc})") from exc
        return gathered

    def _agree(self, plan):
        box = [plan.to_dict() if plan is not None else None]
        try:
            src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
            dist.broadcast_object_list(box, src=src, group=self.group)
        except Exception as exc:
            raise PlanAgreementError(f"deepspeed-hetero: data-parallel rank {self.rank} did not receive the new "
                                     f"plan from rank 0; rank 0 failed or timed out ({exc})") from exc
        return Plan.from_dict(box[0])

    def close(self):
        if self.emulator is not None:
            self.emulator.close()
