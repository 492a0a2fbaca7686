# SPDX-License-Identifier: Apache-2.0
"""The runtime controller: one per engine, it owns every decision the fork takes while training.

The engine calls four hooks (all no-ops when heterogeneous mode is off): ``micro_step_begin`` at
forward, ``backward_begin``, ``micro_step_end`` after backward and ``step_end`` after the
optimizer step. ``HeterogeneousRuntime`` routes them to the modules that do the work:

- ``measure.timing``: this rank's own time per micro-step and per step;
- ``emulation.limits``: an emulated rank's speed schedule and memory;
- ``cluster.agreement``: its only collectives (pool measurements, broadcast rank 0's decision);
- ``planning.profiling``: profiling steps -> time models, memory limits, the next plan (pure);
- ``planning.rebalance``: when to move work during training, and whether a switch made the step
  slower (pure).

Its phases (``Phase``) are explicit, and one ``state_dict`` covers all of its state, so that a
resumed run continues in the same phase with the same pending check:

1. ``PROFILING`` (strategy ``compute_aware``, ``profile_steps`` > 0): after each step every rank's
   measurements are gathered to every rank (each keeps them: checkpoints and the autotuner read
   them); rank 0 fits ``time = a_i + b_i * mbs`` and the activation bytes per rank, derives each
   rank's memory limit and plans; the plan is broadcast and every rank switches to it at this
   step boundary (the samplers follow). Any allocation gives the exact global-batch gradient
   (loss weighting), so profiling trains for real.
2. ``VERIFYING``: a switch waits for one check of its observed step time, ``check_interval`` steps
   later; a switch that made the step slower beyond the noise is reverted. Then ``STATIC``.
3. ``MONITORING`` (``scheduler.dynamic_rebalancing``): a check every ``check_interval`` steps,
   which first judges the last switch, then may rebalance.
4. ``STATIC``: the plan stays; nothing is timed or gathered (``reschedule_workload`` still re-plans
   on demand).

The checks gather the interval's measurements to rank 0 alone; its decision, with the measured
memory peaks every rank's pool report shows, is broadcast. The comm clock (time in collectives,
subtracted from compute) runs only while something reads it: profiling, verifying, monitoring,
the heterogeneous profiler's recording, or time dilation.
"""

import copy
import enum
import statistics
import time
from dataclasses import asdict, replace

from deepspeed import comm as dist
from deepspeed.utils import logger

from .config.errors import one_line_config_errors
from .cluster.agreement import (Agreement, PlanAgreementError, PlanDecision, merge_replicas, slowest,
                                slowest_micro_step)
from .startup import apply_plan, rank_memory_meter
from .memory.pool import memory_capacities
from .data.fed_batch import fed_size, judge_feeding, leading_batch_size, raised_on_every_rank
from .integrations.loss_normalization import LossWeighting
from .data.exchange_account import ExchangeAccount
from .data.resplit import agree, resplit_inputs, return_outputs
from .emulation.limits import EmulatedLimits, EmulatedOutOfMemoryError, emulation_note, profiled_speeds_note
from .measure import comm_clock
from .memory.model_state import ActivationMeter
from .memory.rank_memory import RankMemory
from .planning.planner import Plan, TimeModel, plan_micro_batches
from .planning.profiling import (measured_rates, measured_time_models, memory_limits, plan_after_profiling_step,
                                 reference_walls)
from .planning.rebalance import (RebalanceEvent, RebalancePolicy, Rebalancer, balanced_models,
                                 models_from_utilization, window_models)
from .measure.timing import StepTimer, StepTiming
from .cluster.topology import topology_note

__all__ = ["HeterogeneousRuntime", "Phase", "PlanAgreementError", "EmulatedOutOfMemoryError", "RescheduleError"]


class RescheduleError(RuntimeError):
    """``reschedule_workload()`` has nothing to re-plan from (raised on every rank together)."""


class Phase(str, enum.Enum):
    """What the controller does at each step end (see the module docstring)."""

    PROFILING = "profiling"
    VERIFYING = "verifying"
    MONITORING = "monitoring"
    STATIC = "static"


class HeterogeneousRuntime:
    """Created by the engine at its first hook (``state.runtime``); one per engine."""

    def __init__(self, engine):
        self.engine = engine
        self.config = engine._config
        # Errors every rank raises together during training end the job with one line from rank 0.
        one_line_config_errors()
        self.state = self.config.heterogeneous
        self.settings = self.state.settings.config
        self.rank = self.state.dp_rank
        # Measurements are pooled and the plan decided over the whole world: with model
        # parallelism, the members of one data-parallel replica must run the same plan, and the
        # slowest member sets the replica's pace.
        self.agreement = Agreement(f"data-parallel rank {self.rank}")
        self.capacities = memory_capacities(self.state)
        self.limits = EmulatedLimits(self.settings.emulation, self.state.emulated_rank,
                                     self.capacities[self.rank] if self.capacities else None)
        self.timer = StepTimer()
        self.meter = ActivationMeter()
        self.memory = RankMemory(self.state, self.rank, engine, rank_memory_meter)
        self._activations_size = None  # the micro-batch size whose activations the memory pool holds
        self.history = []  # per profiling step: every data-parallel rank's pooled measurements
        self.base_models = None  # the profiled fits alone: what an on-demand re-plan scales
        self.samplers = []  # batch samplers that follow the plan (the engine's loader's, users' registered)
        self.deferred_sampler_states = []  # saved positions of samplers not registered when a checkpoint loaded
        self.engine_loader = False  # the engine's own loader (training_data=) feeds this rank
        self.check_fed_batch = self.settings.check_fed_batch
        self._fed = None  # the size of the micro-batch this rank computes (None: not known)
        self._split = None  # this micro-step's re-split (data.resplit.Split), None when nothing moved
        self._resplit = False  # the last training forward re-split what the ranks were fed (agreed by all)
        self._data_parallel_world = dist.get_world_size() if dist.is_initialized() else 1
        self.loss_weighting = LossWeighting(self.state, self.rank, self._data_parallel_world)
        self._recorded_bytes = (0, 0)  # the two counters at the last profiler record
        self.exchange = ExchangeAccount()  # what re-splitting costs (data/exchange_account.py)
        self.gas_origin = 0  # the engine's micro-step count when this rank's current gas took effect
        scheduler = self.settings.scheduler
        self.dynamic = scheduler.dynamic_rebalancing and self.settings.strategy.adapts
        profiles = self.settings.strategy.adapts and self.settings.profile_steps > 0
        self.phase = Phase.PROFILING if profiles else self._after_switch(verify=False)
        # Every rank builds one; only rank 0's decides. Without dynamic rebalancing it serves
        # reschedule_workload() alone, which needs no policy.
        policy = RebalancePolicy(scheduler.imbalance_threshold, scheduler.cooldown_checks) if self.dynamic else None
        self.rebalancer = Rebalancer(policy)
        self.events = []  # RebalanceEvent per plan change after profiling (every rank keeps them)
        self.recording = False  # per-step records for the heterogeneous profiler
        self.records = []
        self._window = []  # this rank's StepTimings since the last check
        self._agreement_s = 0.0  # the last agreement's own seconds, which are not a step's
        self._update_comm_clock()
        self.limits.apply_speed_schedule(1)
        # A CPU quota does not bind where other processes hold the cores: measured, not assumed.
        if self.limits.check_speeds(self.agreement.gather_from_every_rank) is not None:
            self._update_comm_clock()  # a rank moved to dilation times its collectives from now on
        # On more than one host, the hosts and their measured links go under the title.
        self.log_plan("plan at start-up", self.plan,
                      "\n  ".join(filter(None, [topology_note(self.state.topology), self._emulation_note()])) or None)
        if self.state.pipeline is not None and dist.get_rank() == 0:  # the stages, under the replicas' plan
            print(self.state.pipeline.table(), flush=True)

    @property
    def plan(self):
        return self.state.plan

    def _emulation_note(self):
        return emulation_note(self.settings.emulation, self.limits.mode, self.limits.memory_mode,
                              self.limits.speed_check)

    @property
    def profiling(self):
        return self.phase is Phase.PROFILING

    def _after_switch(self, verify):
        """The phase after profiling or a check: monitoring with dynamic rebalancing, else verifying
        while a switch awaits its check, else static."""
        if self.dynamic:
            return Phase.MONITORING
        return Phase.VERIFYING if verify else Phase.STATIC

    def _enter(self, phase):
        self.phase = phase
        self._update_comm_clock()

    def _update_comm_clock(self):
        """Time collectives only while a reading of the clock is used (see the module docstring)."""
        comm_clock.set_timing(self.phase is not Phase.STATIC or self.recording or self.limits.dilates_time)

    @property
    def steps(self):
        """Optimizer steps taken. The engine's own count, not a second one: the runtime is created
        at the first forward (count 0), the hook runs right after the engine increments it, and
        the speed schedule, event steps and logs then use the step numbers the user sees. The
        number of profiling steps taken is ``len(history)``, which a resumed count cannot skew."""
        return self.engine.global_steps

    @property
    def emulation_mode(self):
        return self.limits.mode

    def log_plan(self, title, plan, change=None):
        """Print ``plan`` as one block on global rank 0: a title, an optional line saying what
        changed, and the plan's table.

        Printed, not logged: DeepSpeed's logger shows WARNING and above by default, and a plan is
        not a warning, yet it is the first thing a user of the fork wants to see (as the flops
        profiler prints its report)."""
        if dist.get_rank() != 0:
            return
        names = self.state.device_names
        lines = [f"[deepspeed-hetero] {title} (strategy {plan.strategy}):"]
        if change:
            lines.append(f"  {change}")
        lines.append(plan.format_table(names))
        print("\n".join(lines), flush=True)

    # -- hooks --------------------------------------------------------------------------------

    @property
    def times_each_micro_step(self):
        """Profiling, recording and time dilation need each micro-step's time (a device
        synchronisation at both ends); dynamic rebalancing's monitoring times whole steps."""
        return self.profiling or self.recording or self.limits.dilates_time

    @property
    def measuring_memory(self):
        """Activation bytes are counted while profiling with known capacities, or on a rank whose
        emulated memory is enforced after profiling."""
        return ((self.profiling and self.capacities is not None) or self.limits.capacity_bytes is not None
                or self.recording or (self.state.memory_pool is not None
                                      and self._activations_size != self.config.train_micro_batch_size_per_gpu))

    @property
    def resplits(self):
        """Whether the last training forward re-split what the ranks were fed (``data/resplit.py``),
        as every rank agreed at that forward (``data.fed_batch.judge_feeding``): ``auto`` unless the
        engine's loader or a registered heterogeneous sampler feeds the ranks their plan or the
        inputs are not batch-first (``check_fed_batch: false``), and only where the data-parallel
        ranks are the whole world (no model or sequence parallelism)."""
        return self._resplit

    @property
    def feeds_plan(self):
        """This rank's own view: the engine's loader or a registered heterogeneous sampler feeds it."""
        return bool(self.engine_loader or self.samplers)

    def _agree_on_feeding(self, inputs, kwargs):
        """Every rank's data-parallel rank, way of feeding and fed size (kept as ``_fed``), gathered
        at this forward (one small all-gather), and what they imply for all of them alike: whether to re-split, or
        the error every rank raises. Rank-local facts (a sampler registered on one rank only, one
        rank fed the wrong size) would otherwise send the ranks down different paths: one waiting
        in a collective the others never enter."""
        fed = self._fed = leading_batch_size(inputs, kwargs or {}) if self.check_fed_batch else None
        count_given = (kwargs or {}).get("num_items_in_batch") is not None
        everyone = agree(self.rank, int(self.feeds_plan), -1 if fed is None else fed, int(count_given))
        # Whether some rank's loss may divide by a caller's count: the forward's end then agrees on it.
        # Not where the plan's own sampler feeds the ranks: HeterogeneousTrainer weighs those itself.
        self.loss_weighting.count_given = any(row[3] for row in everyone) and not any(row[1] for row in everyone)
        return judge_feeding(self.plan, [row[:3] for row in everyone], self.settings.resplit_fed_batches,
                             self.check_fed_batch, self._data_parallel_world == self.plan.world_size)

    def micro_step_begin(self, inputs=(), kwargs=None):
        """A training forward begins: returns the ``(inputs, kwargs)`` the model computes (this
        rank's planned share when the ranks were fed otherwise and re-splitting is on)."""
        self._split = None
        self.loss_weighting.begin_forward()
        self.exchange.begin_micro_step()
        if self.state.pipeline is not None or self.plan.per_rank_gas:
            # No collective here where the ranks do not run their forwards together: a pipeline's
            # stages run them at different times, and per-rank gas gives the ranks different
            # numbers of them. The pipeline engine's own loader, and the engine's loader that per-rank
            # gas requires, feed each rank its plan.
            self._resplit = False
            self._fed = fed_size(self.plan, self.rank, inputs, kwargs, engine_loader=self.engine_loader,
                                 check=self.check_fed_batch)
        else:
            self._resplit = self._agree_on_feeding(inputs, kwargs)
        if self._resplit:
            planned = self.plan.micro_batch_sizes
            inputs, kwargs, self._split = resplit_inputs(tuple(inputs), dict(kwargs or {}), planned, self.rank,
                                                         pad_token_id=self._pad_token_id(), clock=self.exchange.clock)
            self._fed = planned[self.rank]
            self.exchange.resplit(None if self._split is None else self._split.received_bytes((inputs, kwargs)))
        # Some rank was given a caller's count of the items its loss may divide by (the Trainer's
        # num_items_in_batch, counted over what was fed, passed through unchanged): whether the loss
        # really divides by it is seen as the model computes it, and the weight follows at the
        # forward's end, re-split or not.
        self.loss_weighting.watch(self.engine.module, kwargs)
        if self.settings.loss_items is not None:
            self.loss_weighting.weigh_items(self.settings.loss_items, inputs, kwargs)
        if self.measuring_memory:
            self.meter.start()
        if self.times_each_micro_step or self.dynamic:
            self.timer.begin_micro_step(per_micro_step=self.times_each_micro_step)
        # On an asynchronous device, collectives are timed to completion while micro-steps are
        # timed; nothing on the CPU accelerator (comm_clock.synchronize_collectives).
        comm_clock.synchronize_collectives(self.times_each_micro_step)
        self.limits.begin_compute()  # time dilation stretches compute before each collective from here
        return inputs, kwargs

    def forward_end(self, outputs):
        """The forward's outputs as the caller gets them: after a re-split, every batch-first output
        returns to the rank that was fed its sample. Every loss is weighted by the rows this rank
        computed, as the plan says; a loss over the returned outputs is a loss over what the rank
        was fed, and the exchange's backward rescales their gradient by fed / computed rows, so it
        counts as such (whatever arithmetic or backward style follows). A forward given
        ``num_items_in_batch`` (the Trainer's count of the fed items) whose loss divides by it is
        weighted by the count's share of the ranks' sum (``LossWeighting``), and the returned rows'
        gradient is not rescaled."""
        self.loss_weighting.end_forward(self.engine.module, items_weighted=self.settings.loss_items is not None)
        split = self._split
        if split is None or not self.settings.return_outputs:
            return outputs
        scale = 1.0 if self.loss_weighting.caller_counts else split.fed[split.rank] / split.planned[split.rank]
        returned = return_outputs(outputs, split, scale, clock=self.exchange.clock)
        self.exchange.returned(split.received_bytes(returned, outputs=True))
        return returned

    def _pad_token_id(self):
        """The model's padding token (a transformers model's ``config.pad_token_id``), which pads
        ``input_ids`` when the ranks' sequence lengths differ; None: 0."""
        config = getattr(getattr(self.engine, "module", None), "config", None)
        value = getattr(config, "pad_token_id", None)
        return value if isinstance(value, int) else None

    @property
    def process_count(self):
        """The processes the loss counts are summed over (the whole world)."""
        return self._data_parallel_world

    def backward_begin(self, loss=None):
        """engine.backward() starts: the forward part of the micro-step ends here (recorded only;
        a torch-style loss.backward() leaves forward and backward as one span)."""
        if self.recording:
            self.timer.end_forward()

    def micro_step_end(self):
        self.state.weight_override = None
        self.exchange.end_micro_step(moved=self._split is not None)
        self._split = None
        activations = self.meter.stop() if self.meter.active else None
        # The size that was fed (checked against the plan at forward), else the planned one.
        size = self._fed if self._fed is not None else self.config.train_micro_batch_size_per_gpu
        # The profiling steps measure what the plan must fit; the plan is enforced after.
        if activations is not None and not self.profiling:
            self.limits.check_memory(size, self.memory.model_state_bytes(), activations)
        if activations is not None and self.state.memory_pool is not None and size != self._activations_size:
            # The predicted peak follows the micro-batch in force (measured again after a switch).
            self.state.memory_pool.record_activations(self.rank, activations)
            self._activations_size = size
        self.timer.end_micro_step(size, activations, on_compute=self.limits.after_compute, split=self.recording)

    def step_end(self):
        timing = self.timer.end_step()
        self.memory.report_own_peak()
        if self.recording:
            self._record(timing)
        self.limits.apply_speed_schedule(self.steps + 1)
        if self.phase is Phase.PROFILING:
            self._profiling_step(timing)
        elif self.phase in (Phase.VERIFYING, Phase.MONITORING):
            self._window.append(timing)
            # A check needs a whole interval at the plan in force (the same on every rank: the
            # window restarts at the end of profiling and at every check).
            if len(self._window) >= self.settings.scheduler.check_interval:
                self._check_rebalance()

    # -- the heterogeneous profiler -----------------------------------------------------------

    def start_recording(self):
        """Record every step from the next one on (the heterogeneous profiler); the first record's
        wall time starts now, not at the last step end (anything done in between is not a step)."""
        self.records = []
        self.recording = True
        self._recorded_bytes = (self.resplit_input_bytes, self.resplit_output_bytes)
        self._update_comm_clock()
        self.timer.restart()

    def stop_recording(self):
        self.recording = False
        self._update_comm_clock()
        return list(self.records)

    def _record(self, timing):
        received = (self.resplit_input_bytes, self.resplit_output_bytes)
        self.records.append(timing.record(self.steps, self.config.train_micro_batch_size_per_gpu,
                                          received[0] - self._recorded_bytes[0], received[1] - self._recorded_bytes[1]))
        self._recorded_bytes = received

    # -- profiling ----------------------------------------------------------------------------

    _SEQUENCES = {"samples": slowest_micro_step, "step_times": slowest, "walls": slowest}

    def _pooled(self, entry, what):
        """Every rank's measurements, one entry per data-parallel rank, on every rank."""
        gathered = self.agreement.gather_from_every_rank(entry, what)
        return merge_replicas(gathered, self.plan.world_size, self._SEQUENCES, error=PlanAgreementError)

    def _profiling_step(self, timing):
        peak = self.memory.measured_peak_bytes()
        mine = {"dp_rank": self.rank, "samples": timing.samples, "step_overhead": timing.step_overhead,
                "state_bytes": self.memory.model_state_bytes() if self.capacities else 0,
                "peak_bytes": peak, "capacity_peak_bytes": peak if self.memory.meter.measures_capacity else None,
                "wall": max(timing.wall - self._agreement_s, 0.0), **self.exchange.since_last_pooling(reset=False)}
        began = time.perf_counter()
        self.history.append(self._pooled(mine, f"the measurements of step {self.steps} to agree on a plan"))
        self.memory.record_gathered(*RankMemory.of_gathered(self.history[-1]))
        last = len(self.history) >= self.settings.profile_steps
        decision = self._decide_after_profiling(last) if dist.get_rank() == 0 else None
        decision = self.agreement.broadcast_from_rank0(decision, "the new plan")
        decision.raise_failure(f"no plan fits after profiling step {self.steps}")
        new_plan = Plan.from_dict(decision.plan)
        if (new_plan.micro_batch_sizes, new_plan.gradient_accumulation_steps) != (
                self.plan.micro_batch_sizes, self.plan.gradient_accumulation_steps):
            self.switch_to(new_plan, f"plan after profiling step {self.steps}")
        if last and decision.note:
            self._log_decision(f"after profiling (step {self.steps}): {decision.note}")
        if last:
            self._window = []
            # The switch is judged one check interval later (the first check with dynamic
            # rebalancing; without it, this one check and no collective in between).
            self._enter(self._after_switch(decision.verify))
        self._agreement_s = time.perf_counter() - began

    def _decide_after_profiling(self, last):
        """Rank 0's ``PlanDecision``: the plan for the next step, or the failure every rank raises.

        Any exception is sent too: raised here alone, it would leave the other ranks waiting in
        the broadcast until the process group's time-out."""
        try:
            rebalancer = self.rebalancer
            if rebalancer.startup_plan is None:
                # The first profiling step ran it, or its cap within memory before activations were measured.
                rebalancer.startup_plan = self.state.reference_plan or self.plan
            startup = rebalancer.startup_plan
            steps_left = max(self.settings.profile_steps - len(self.history), 0)
            decision = plan_after_profiling_step(self.history, self.plan, self.state.base_gas, self.memory_limits(),
                                                 self.per_rank_gas_allowed, steps_left, startup,
                                                 strategy=self.settings.load_balancing_strategy)
            plan = decision.plan
            if not last:
                return PlanDecision(plan=plan.to_dict())
            _, self.base_models = measured_time_models(self.history, self.state.base_gas)
            self.exchange.update_estimate(self.history[-1])
            kept_fed = self._worth_resplitting(plan, decision.models)
            if kept_fed is not plan:
                plan, decision = kept_fed, replace(decision, plan=kept_fed,
                                                   note="; ".join(filter(None, [decision.note, self.exchange.note])))
            # What dynamic rebalancing scales. A start-up plan kept within the noise has no models:
            # with dynamic rebalancing the first check fits per-sample models from its own interval
            # (so a plan kept for noise alone is corrected once the checks measure a difference);
            # without, it is the reference of drift only.
            if decision.models is None and self.dynamic:
                rebalancer.plan_chosen(None)
            else:
                rebalancer.plan_chosen(decision.models or balanced_models(plan))
            emulated = profiled_speeds_note(self.settings.emulation, measured_rates(self.history), self.steps)
            note = "; ".join(filter(None, [decision.note, emulated])) or None
            verify = False
            if (plan.micro_batch_sizes, plan.gradient_accumulation_steps) != (
                    self.plan.micro_batch_sizes, self.plan.gradient_accumulation_steps):
                unchecked = rebalancer.switched(self.plan, plan, reference_walls(self.history, startup), None,
                                                "switch after profiling")
                verify = unchecked is None
                note = "; ".join(filter(None, [note, unchecked]))
            return PlanDecision(plan=plan.to_dict(), note=note, verify=verify)
        except Exception as exc:  # noqa: BLE001 -- every failure must reach every rank
            return PlanDecision.failed(exc)

    def _log_decision(self, text):
        """One line on global rank 0 (printed, like ``log_plan``): why a plan was kept or reverted."""
        if dist.get_rank() == 0:
            print(f"[deepspeed-hetero] {text}", flush=True)

    def measured_time_models(self):
        """Per-rank time models fitted to the profiling steps (see ``profiling.measured_time_models``)."""
        models, self.base_models = measured_time_models(self.history, self.state.base_gas)
        return models

    def memory_limits(self):
        """Per-rank micro-batch limits from the profiling steps' activations, or None without capacities."""
        return memory_limits(self.history, self.capacities, self.state.device_names,
                             self.state.settings.memory.hbm_utilization_threshold)

    @property
    def per_rank_gas_allowed(self):
        """ZeRO-0/1 reduce gradients only at the accumulation boundary, so ranks may run different
        numbers of micro-steps; ZeRO-2/3 reduce every micro-step and need equal gas. An optimizer
        offloaded to the host sizes its accumulation buffers by the gas at start-up."""
        return (int(self.engine.zero_optimization_stage()) <= 1 and not self.engine.zero_use_cpu_optimizer()
                and self.engine_loader and self.settings.loss_items is None)

    # -- dynamic rebalancing ------------------------------------------------------------------

    def _best_plan_for(self, models):
        best = plan_micro_batches(models, train_batch_size=self.plan.train_batch_size,
                                  gradient_accumulation_steps=self.state.base_gas,
                                  strategy=self.settings.load_balancing_strategy,
                                  max_micro_batch=self.memory_limits(), allow_per_rank_gas=self.per_rank_gas_allowed)
        return self._worth_resplitting(best, models)

    @property
    def resplit_input_bytes(self):
        """Input bytes other ranks sent this rank by re-splitting, in all."""
        return self.exchange.input_bytes

    @property
    def resplit_output_bytes(self):
        """Output bytes returned to this rank from the ranks that computed them, in all."""
        return self.exchange.output_bytes

    def _worth_resplitting(self, plan, models):
        """Rank 0: ``plan``, or the loader's split when re-splitting to ``plan`` costs more than it
        saves (``self.exchange.note`` says why)."""
        self.exchange.note = None
        if not self.resplits or models is None:
            return plan
        return self.exchange.worth_resplitting(plan, models)

    def _check_rebalance(self, forced_models=None, on_demand=False):
        """Every rank: pool the interval's measurements, let rank 0 decide, switch together."""
        steps, self._window = self._window, []
        count = max(len(steps), 1)
        walls = [step.wall for step in steps]
        if walls:  # the first step after the last agreement carried that agreement's time
            walls[0] = max(walls[0] - self._agreement_s, 0.0)
        mine = {"dp_rank": self.rank, "samples": [s for step in steps for s in step.samples],
                "step_times": [step.time_per_micro_step for step in steps if step.time_per_micro_step is not None],
                "step_overhead": sum(step.step_overhead for step in steps) / count,
                "wall": sum(walls) / count, "walls": walls, "peak_bytes": self.memory.measured_peak_bytes(),
                **self.exchange.since_last_pooling(reset=True)}
        began = time.perf_counter()
        gathered = self.agreement.gather_to_rank0(mine, f"the measurements of step {self.steps} to agree on a plan")
        decision = None
        if gathered is not None:  # rank 0: whatever fails here must reach every rank in the broadcast
            try:
                everyone = merge_replicas(gathered, self.plan.world_size, self._SEQUENCES, error=PlanAgreementError)
                decision = self._decide_rebalance(everyone, forced_models, on_demand)
                decision.peaks, decision.activations = RankMemory.of_gathered(everyone)
            except Exception as exc:  # noqa: BLE001 -- every failure must reach every rank
                decision = PlanDecision.failed(exc)
        decision = self.agreement.broadcast_from_rank0(decision, "the rebalancing decision")
        decision.raise_failure(f"rebalancing at step {self.steps} failed")
        self.memory.record_gathered(decision.peaks, decision.activations)
        # Without dynamic rebalancing a switch is checked once (the window served that check); an
        # on-demand re-plan during profiling leaves profiling to go on.
        if self.phase is not Phase.PROFILING:
            self._enter(self._after_switch(decision.verify))
        if decision.note:
            self._log_decision(f"step {self.steps}: {decision.note}")
        if decision.plan is not None:
            new_plan, old = Plan.from_dict(decision.plan), self.plan
            kind = "revert" if decision.revert else "rebalance"
            self.switch_to(new_plan, f"{kind} at step {self.steps} ({decision.reason})")
            self.events.append(RebalanceEvent(self.steps, tuple(old.micro_batch_sizes),
                                              tuple(new_plan.micro_batch_sizes), decision.gain, decision.wall,
                                              kind=kind))
        self._agreement_s = time.perf_counter() - began
        return self.plan

    def _decide_rebalance(self, everyone, forced_models, on_demand):
        """Rank 0's ``PlanDecision``: first judge the last switch on the steps since (revert it if
        it made the step slower), then, with dynamic rebalancing or on demand, the check itself.
        Any exception is returned as the decision's failure, for every rank to raise."""
        try:
            walls = [max(step) for step in zip(*(entry["walls"] for entry in everyone))]
            wall = statistics.median(walls) if walls else max(entry["wall"] for entry in everyone)
            self.exchange.update_estimate(everyone)
            judged = self._observe_last_event(walls)
            if judged is not None and judged.revert:
                # A comparison's first half leaves the switch pending: its second half is judged
                # one interval later, with or without dynamic rebalancing.
                return PlanDecision(plan=judged.plan.to_dict(), reason=judged.reason, gain=judged.predicted_gain,
                                    wall=wall, revert=True, verify=self.rebalancer.pending is not None)
            note = None if judged is None else judged.reason
            if on_demand:
                models = forced_models or window_models([e["samples"] for e in everyone], self.base_models,
                                                        [e["step_overhead"] for e in everyone], self.state.base_gas)
                decision = self.rebalancer.check_on_demand(self.plan, models, self._best_plan_for,
                                                           self.settings.scheduler.imbalance_threshold)
            elif self.dynamic:
                decision = self.rebalancer.check(self.plan, [e["step_times"] for e in everyone], self._best_plan_for)
            else:  # the check of a switch without dynamic rebalancing (again while too few steps)
                return PlanDecision(reason=note or "nothing to check", note=note,
                                    verify=self.rebalancer.pending is not None)
            if not decision.rebalance:
                return PlanDecision(reason=decision.reason, gain=decision.predicted_gain,
                                    note="; ".join(filter(None, [note, self.exchange.note])) or None,
                                    verify=self.rebalancer.pending is not None)
            old = self.plan
            unchecked = self.rebalancer.switched(old, decision.plan, walls, self.rebalancer.previous_models,
                                                 f"rebalance at step {self.steps}")
            return PlanDecision(plan=decision.plan.to_dict(), reason=decision.reason, gain=decision.predicted_gain,
                                wall=wall, verify=unchecked is None,
                                note="; ".join(filter(None, [note, self.exchange.note, unchecked])))
        except Exception as exc:  # noqa: BLE001 -- every failure must reach every rank
            return PlanDecision.failed(exc)

    def _observe_last_event(self, walls):
        """Judge the last switch on ``walls`` (per-step wall seconds, the slowest rank's, at the plan
        in force since): None when nothing is pending, else the Decision (a revert, or kept); the
        event's observed step time and gain are filled in and logged."""
        judged = self.rebalancer.judge_switch(self.plan, walls)
        event = self.events[-1] if self.events else None
        if walls and event is not None and event.step_time_after is None and event.step < self.steps:
            event.step_time_after = sorted(walls)[len(walls) // 2]
            logger.info(f"deepspeed-hetero {event.kind} at step {event.step}: predicted gain "
                        f"{event.predicted_gain:.1%}, observed {event.observed_gain:.1%} (step time "
                        f"{event.step_time_before:.4g} s -> {event.step_time_after:.4g} s)")
        return judged

    def reschedule(self, utilization_metrics=None):
        """Re-plan now (every rank calls this at the same step boundary), from ``utilization_metrics``
        (per-rank busy seconds per step: a list, a dict with ``busy_seconds``, or the heterogeneous
        profiler's ``get_metrics()``) or, without them, from the steps since the last check."""
        forced = None
        if utilization_metrics is not None:
            forced = models_from_utilization(utilization_metrics, self.plan)
        elif not self._window:
            # The phase and the window are alike on every rank, so every rank raises here together.
            raise raised_on_every_rank(RescheduleError(self._nothing_measured()))
        return self._check_rebalance(forced_models=forced, on_demand=True)

    def _nothing_measured(self):
        """Why ``reschedule_workload()`` without metrics has nothing to re-plan from, in one line."""
        alternative = ("pass utilization_metrics (per-rank busy seconds per step, e.g. "
                       "HeterogeneousProfiler(engine).get_metrics()) to re-plan from them now")
        if self.phase is Phase.PROFILING:
            return (f"reschedule_workload(): the profiling steps are still measuring ({len(self.history)} of "
                    f"{self.settings.profile_steps} taken) and re-plan at their end; {alternative}")
        if self.phase is Phase.STATIC:
            return ("reschedule_workload(): nothing is measured once the plan has settled (profiling is over and "
                    "heterogeneous_config.scheduler.dynamic_rebalancing is off: timing every step would cost a "
                    f"device synchronisation per step); {alternative}, or turn on dynamic_rebalancing, whose "
                    "checks measure every step")
        return (f"reschedule_workload(): no step was measured since the last check (step {self.steps}); train "
                f"some steps first, or {alternative}")

    def restore_deferred_sampler(self, sampler, index):
        """Resume a sampler registered after the checkpoint was loaded at its saved position (the
        ``index``-th registered takes the ``index``-th saved)."""
        if index < len(self.deferred_sampler_states):
            from .checkpoint import load_sampler
            load_sampler(sampler, self.deferred_sampler_states[index], index)

    def switch_to(self, plan, reason):
        """Adopt ``plan`` from the next step on (every rank calls this at the same boundary)."""
        old = self.plan
        apply_plan(self.config, plan)
        if plan.gradient_accumulation_steps[self.rank] != old.gradient_accumulation_steps[self.rank]:
            # The engine finds the accumulation boundary by counting micro-steps from here on.
            self.gas_origin = self.engine.micro_steps + 1
        gas = list(plan.gradient_accumulation_steps) if plan.per_rank_gas else None
        for sampler in self.samplers:
            sampler.set_micro_batch_sizes(list(plan.micro_batch_sizes), gradient_accumulation_steps=gas)
        change = (f"micro-batches {list(old.micro_batch_sizes)} -> {list(plan.micro_batch_sizes)}, gas "
                  f"{list(old.gradient_accumulation_steps)} -> {list(plan.gradient_accumulation_steps)}, predicted step "
                  f"time {old.format_step_time()} -> {plan.format_step_time()}")
        moved = self.exchange.moved_since_last_plan(self.steps)
        self.log_plan(reason, plan, change=change + (f"\n  {moved}" if moved else ""))

    # -- checkpoints (checkpoint.py) ----------------------------------------------------------

    def state_dict(self):
        """The controller's state as plain values (a checkpoint holds no class of the fork): its
        phase, the profiling steps' measurements, the fitted models, the rebalancer (the models and
        baseline of the plan in force, the switch awaiting its check, the reverted plans, the
        start-up plan), the plan changes, and what re-splitting a stock loader's batches costs (the
        latest pooled exchange estimate and the sizes the loader fed), which decides whether a
        re-plan is worth its exchange. Rank 0's record is the one a checkpoint keeps; only rank 0's
        rebalancer decides. Each rank's steps since the last check are ``window_state``."""
        return {
            "phase": self.phase.value,
            "history": copy.deepcopy(self.history),
            "base_models": None if self.base_models is None else [[m.a, m.b] for m in self.base_models],
            "rebalancer": self.rebalancer.state_dict(),
            "events": [asdict(event) for event in self.events],
            "exchange": self.exchange.state_dict(),
        }

    def window_state(self):
        """This rank's steps since the last check (its own measurements: per rank)."""
        return [asdict(timing) for timing in self._window]

    def load_state_dict(self, state, window=None):
        """Continue from a checkpoint, between steps (``engine.load_checkpoint`` restored the step
        count). ``state``: ``state_dict()`` of the saving run on the same cluster; None to start
        over on this one (another cluster: profiling runs again from the plan in force; the old
        cluster's measurements and rebalancing history no longer apply). ``window``: this rank's
        ``window_state()``, so that the checks keep their cadence."""
        if state is not None:
            self.history = copy.deepcopy(state["history"])
            models = state["base_models"]
            self.base_models = None if models is None else [TimeModel(a, b) for a, b in models]
            self.rebalancer.load_state_dict(state["rebalancer"])
            self.events = [RebalanceEvent(**{**event, "old_sizes": tuple(event["old_sizes"]),
                                             "new_sizes": tuple(event["new_sizes"])}) for event in state["events"]]
            self._window = [StepTiming(**timing) for timing in window or []]
            self.exchange.load_state_dict(state.get("exchange"))
            self._enter(self._resumed_phase(state))
        # DeepSpeed does not save the engine's micro-step count: accumulation boundaries are counted
        # from here (a checkpoint is taken at an optimizer step's end).
        self.gas_origin = self.engine.micro_steps
        self.timer.restart()
        self.limits.apply_speed_schedule(self.steps + 1)

    def _resumed_phase(self, state):
        """The saved phase, as far as this run's settings allow it: profiling only where this run
        profiles; a check still due keeps its phase (monitoring with dynamic rebalancing on here)."""
        saved = state.get("phase")
        if saved is None:  # a record without phases: only whether profiling had finished
            saved = Phase.PROFILING.value if state.get("profiling") else None
        if saved == Phase.PROFILING.value and self.phase is Phase.PROFILING:
            return Phase.PROFILING
        # The saved phase alone (the same record on every rank), not the rebalancer's pending switch,
        # which only rank 0's holds: a phase that differed between ranks would pair no collectives.
        return self._after_switch(verify=saved == Phase.VERIFYING.value)

    def close(self):
        self.meter.stop()
        self.limits.close()
        comm_clock.synchronize_collectives(False)
        comm_clock.set_timing(False)
