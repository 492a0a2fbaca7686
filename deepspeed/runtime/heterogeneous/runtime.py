# SPDX-License-Identifier: Apache-2.0
"""The runtime controller: one per engine, it owns every decision the fork takes while training.

The engine calls its hooks (no-ops when heterogeneous mode is off): ``micro_step_begin`` and
``forward_end`` around the forward, ``backward_begin``, ``micro_step_end`` after backward and
``step_end`` after the optimizer step. ``HeterogeneousRuntime`` keeps the phase machine and the
collectives (``cluster.agreement``: pool the measurements, broadcast rank 0's decision) and hands
the work to its parts: ``Feeding`` (what the forward computes, ``control/feeding.py``),
``PlanDecisions`` (rank 0's decisions, ``control/decisions.py``), ``measure.timing`` (this rank's
own time), ``emulation.limits`` (an emulated rank's speed and memory), ``memory.rank_memory`` (its
peaks) and the ``ExchangeAccount`` (what re-splitting moved and cost).

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

import enum
import time
from dataclasses import asdict

from deepspeed import comm as dist

from .config.errors import one_line_config_errors
from .cluster.agreement import (Agreement, PlanAgreementError, PlanDecision, merge_replicas, slowest,
                                slowest_micro_step)
from .cluster.topology import topology_note
from .data.exchange_account import ExchangeAccount
from .elastic.periodic import PeriodicCheckpoints
from .data.fed_batch import raised_on_every_rank
from .control.decisions import PlanDecisions, nothing_measured, plan_block
from .emulation.limits import EmulatedLimits, EmulatedOutOfMemoryError, emulation_note
from .control.feeding import Feeding
from .measure import comm_clock
from .measure.timing import StepRecords, StepTimer, StepTiming, interval_measurements
from .memory.model_state import ActivationMeter
from .memory.pool import memory_capacities
from .memory.rank_memory import RankMemory
from .planning.planner import Plan
from .planning.rebalance import models_from_utilization
from .startup import apply_plan, rank_memory_meter

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
    """Created on every rank as the engine starts (``state.runtime``,
    ``HeterogeneousEngineMixin._heterogeneous_start_runtime``); one per engine. Its construction
    runs collectives (the emulation's speed check), so it is never created where only some ranks
    are."""

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
        self._data_parallel_world = dist.get_world_size() if dist.is_initialized() else 1
        self.exchange = ExchangeAccount()  # what re-splitting costs (data/exchange_account.py)
        self.feeding = Feeding(engine, self.state, self.exchange, self._data_parallel_world)
        self.gas_origin = 0  # the engine's micro-step count when this rank's current gas took effect
        self.dynamic = self.settings.scheduler.dynamic_rebalancing and self.settings.strategy.adapts
        profiles = self.settings.strategy.adapts and self.settings.profile_steps > 0
        self.phase = Phase.PROFILING if profiles else self._after_switch(verify=False)
        self.decisions = PlanDecisions(self.state, self.capacities, self.exchange, self.dynamic)
        self.records = StepRecords()  # per-step records for the heterogeneous profiler
        self._window = []  # this rank's StepTimings since the last check
        self._agreement_s = 0.0  # the last agreement's own seconds, which are not a step's
        periodic = self.settings.elastic.checkpoint
        self.periodic = None if periodic is None else PeriodicCheckpoints(periodic, self.agreement)
        self._step_completed = False  # an optimizer step ended in the engine.step() now returning
        self._forward_seen = False  # the first training forward restarts the timer (see micro_step_begin)
        self._update_comm_clock()
        self.limits.apply_speed_schedule(1)
        # A CPU quota does not bind where other processes hold the cores: measured, not assumed.
        if self.limits.check_speeds(self.agreement.gather_from_every_rank) is not None:
            self._update_comm_clock()  # a rank moved to dilation times its collectives from now on
        # On more than one host, the hosts and their measured links go under the title.
        notes = [topology_note(self.state.topology),
                 emulation_note(self.settings.emulation, self.limits.mode, self.limits.memory_mode,
                                self.limits.speed_check)]
        self.log_plan("plan at start-up", self.plan, "\n  ".join(filter(None, notes)) or None)
        if self.state.pipeline is not None and dist.get_rank() == 0:  # the stages, under the replicas' plan
            print(self.state.pipeline.table(), flush=True)

    @property
    def plan(self):
        return self.state.plan

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
        as the engine starts (count 0), the hook runs right after the engine increments it, and
        the speed schedule, event steps and logs then use the step numbers the user sees. The
        number of profiling steps taken is ``len(history)``, which a resumed count cannot skew."""
        return self.engine.global_steps

    @property
    def emulation_mode(self):
        return self.limits.mode

    def log_plan(self, title, plan, change=None):
        """Print ``plan`` as one block on global rank 0 (``decisions.plan_block``)."""
        if dist.get_rank() == 0:
            print(plan_block(title, plan, self.state.device_names, change), flush=True)

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
        """Whether the last training forward re-split what the ranks were fed, as every rank agreed
        at that forward (``Feeding``)."""
        return self.feeding.resplit

    @property
    def process_count(self):
        """The processes the loss counts are summed over (the whole world)."""
        return self._data_parallel_world

    def micro_step_begin(self, inputs=(), kwargs=None):
        """A training forward begins: returns the ``(inputs, kwargs)`` the model computes (this
        rank's planned share when the ranks were fed otherwise and re-splitting is on)."""
        if not self._forward_seen:
            # The first step's wall time and time in collectives count from its first forward, not
            # from the engine's start (the rest of its construction, the caller's set-up).
            self._forward_seen = True
            self.timer.restart()
        inputs, kwargs = self.feeding.begin(inputs, kwargs)
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
        """The forward's outputs as the caller gets them (``Feeding.end_forward``)."""
        return self.feeding.end_forward(outputs)

    def backward_begin(self, loss=None):
        """engine.backward() starts: the forward part of the micro-step ends here (recorded only;
        a torch-style loss.backward() leaves forward and backward as one span)."""
        if self.recording:
            self.timer.end_forward()

    def micro_step_end(self):
        self.feeding.end_micro_step()
        activations = self.meter.stop() if self.meter.active else None
        # The size that was fed (checked against the plan at forward), else the planned one.
        fed = self.feeding.fed
        size = fed if fed is not None else self.config.train_micro_batch_size_per_gpu
        # The profiling steps measure what the plan must fit; the plan is enforced after.
        if activations is not None and not self.profiling:
            self.limits.check_memory(size, self.memory.model_state_bytes(), activations)
        if activations is not None and self.state.memory_pool is not None and size != self._activations_size:
            # The predicted peak follows the micro-batch in force (measured again after a switch).
            self.state.memory_pool.record_activations(self.rank, activations)
            self._activations_size = size
        self.timer.end_micro_step(size, activations, on_compute=self.limits.after_compute, split=self.recording)

    def step_end(self):
        self._step_completed = True
        if self.state.low_communication is not None:  # the hosts' replicas meet: part of this step's time
            self.state.low_communication.after_step(self.plan)
        timing = self.timer.end_step()
        self.memory.report_own_peak()
        if self.recording:
            self.records.add(timing, self.steps, self.config.train_micro_batch_size_per_gpu, self._received())
        self.limits.apply_speed_schedule(self.steps + 1)
        if self.phase is Phase.PROFILING:
            self._profiling_step(timing)
        elif self.phase in (Phase.VERIFYING, Phase.MONITORING):
            self._window.append(timing)
            # A check needs a whole interval at the plan in force (the same on every rank: the
            # window restarts at the end of profiling and at every check).
            if len(self._window) >= self.settings.scheduler.check_interval:
                self._check_rebalance()

    def step_done(self):
        """``engine.step()`` is returning (its micro-step counted): a periodic checkpoint is taken
        here, after an optimizer step, when one is due."""
        if self._step_completed:
            self._step_completed = False
            if self.periodic is not None and self.periodic.after_step(self.engine):
                self.timer.restart()  # the save is no step's time: the next step's wall starts now

    # -- the heterogeneous profiler -----------------------------------------------------------

    def start_recording(self):
        """Record every step from the next one on (the heterogeneous profiler); the first record's
        wall time starts now, not at the last step end (anything done in between is not a step)."""
        self.records.start(self._received())
        self._update_comm_clock()
        self.timer.restart()

    def stop_recording(self):
        records = self.records.stop()
        self._update_comm_clock()
        return records

    def _received(self):
        return self.exchange.input_bytes, self.exchange.output_bytes

    @property
    def recording(self):
        return self.records.active

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
                "wall": max(timing.wall - self._agreement_s, 0.0),
                # The agreement's own collectives are not the step's (activation_room.forecast_step_seconds).
                "collective_s": max(timing.in_collectives - self._agreement_s, 0.0),
                **self.exchange.since_last_pooling(reset=False)}
        began = time.perf_counter()
        history = self.decisions.history
        history.append(self._pooled(mine, f"the measurements of step {self.steps} to agree on a plan"))
        self.memory.record_gathered(*RankMemory.of_gathered(history[-1]))
        last = len(history) >= self.settings.profile_steps
        decision = (self.decisions.after_profiling(last, self.steps, self.per_rank_gas_allowed, self.resplits)
                    if dist.get_rank() == 0 else None)
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

    def _log_decision(self, text):
        """One line on global rank 0 (printed, like ``log_plan``): why a plan was kept or reverted."""
        if dist.get_rank() == 0:
            print(f"[deepspeed-hetero] {text}", flush=True)

    @property
    def per_rank_gas_allowed(self):
        """ZeRO-0/1 reduce gradients only at the accumulation boundary, so ranks may run different
        numbers of micro-steps; ZeRO-2/3 reduce every micro-step and need equal gas. An optimizer
        offloaded to the host sizes its accumulation buffers by the gas at start-up."""
        return (int(self.engine.zero_optimization_stage()) <= 1 and not self.engine.zero_use_cpu_optimizer()
                and self.feeding.engine_loader and self.settings.loss_items is None)

    # -- dynamic rebalancing ------------------------------------------------------------------

    def _check_rebalance(self, forced_models=None, on_demand=False):
        """Every rank: pool the interval's measurements, let rank 0 decide, switch together."""
        steps, self._window = self._window, []
        mine = {"dp_rank": self.rank, **interval_measurements(steps, self._agreement_s),
                "peak_bytes": self.memory.measured_peak_bytes(), **self.exchange.since_last_pooling(reset=True)}
        began = time.perf_counter()
        gathered = self.agreement.gather_to_rank0(mine, f"the measurements of step {self.steps} to agree on a plan")
        decision = None
        if gathered is not None:  # rank 0: whatever fails here must reach every rank in the broadcast
            try:
                everyone = merge_replicas(gathered, self.plan.world_size, self._SEQUENCES, error=PlanAgreementError)
                decision = self.decisions.at_check(everyone, forced_models, on_demand, self.steps,
                                                   self.per_rank_gas_allowed, self.resplits)
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
            self.decisions.switched(self.steps, old, new_plan, decision, kind)
        self._agreement_s = time.perf_counter() - began
        return self.plan

    def reschedule(self, utilization_metrics=None):
        """Re-plan now (every rank calls this at the same step boundary), from ``utilization_metrics``
        (per-rank busy seconds per step: a list, a dict with ``busy_seconds``, or the heterogeneous
        profiler's ``get_metrics()``) or, without them, from the steps since the last check."""
        forced = None
        if utilization_metrics is not None:
            forced = models_from_utilization(utilization_metrics, self.plan)
        elif not self._window:
            # The phase and the window are alike on every rank, so every rank raises here together.
            raise raised_on_every_rank(RescheduleError(nothing_measured(
                self.phase.value, len(self.decisions.history), self.settings.profile_steps, self.steps)))
        return self._check_rebalance(forced_models=forced, on_demand=True)

    def switch_to(self, plan, reason):
        """Adopt ``plan`` from the next step on (every rank calls this at the same boundary)."""
        old = self.plan
        apply_plan(self.config, plan)
        if plan.gradient_accumulation_steps[self.rank] != old.gradient_accumulation_steps[self.rank]:
            # The engine finds the accumulation boundary by counting micro-steps from here on.
            self.gas_origin = self.engine.micro_steps + 1
        gas = list(plan.gradient_accumulation_steps) if plan.per_rank_gas else None
        for sampler in self.feeding.samplers:
            sampler.set_micro_batch_sizes(list(plan.micro_batch_sizes), gradient_accumulation_steps=gas)
        change = (f"micro-batches {list(old.micro_batch_sizes)} -> {list(plan.micro_batch_sizes)}, gas "
                  f"{list(old.gradient_accumulation_steps)} -> {list(plan.gradient_accumulation_steps)}, predicted step "
                  f"time {old.format_step_time()} -> {plan.format_step_time()}")
        moved = self.exchange.moved_since_last_plan(self.steps)
        self.log_plan(reason, plan, change=change + (f"\n  {moved}" if moved else ""))

    # -- checkpoints (checkpoint.py) ----------------------------------------------------------

    def state_dict(self):
        """The controller's state as plain values (a checkpoint holds no class of the fork): its
        phase, its decisions' state (``PlanDecisions.state_dict``) and what re-splitting a stock
        loader's batches costs (``ExchangeAccount.state_dict``: the latest pooled exchange estimate
        and the sizes the loader fed), which decides whether a re-plan is worth its exchange.
        Rank 0's record is the one a checkpoint keeps; only rank 0's rebalancer decides. Each rank's
        steps since the last check are ``window_state``."""
        return {"phase": self.phase.value, **self.decisions.state_dict(), "exchange": self.exchange.state_dict()}

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
            self.decisions.load_state_dict(state)
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
