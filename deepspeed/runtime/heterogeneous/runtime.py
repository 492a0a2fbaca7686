# SPDX-License-Identifier: Apache-2.0
"""The fork's per-engine state while training: timing, profiling, re-planning, emulation.

The engine calls three hooks (all no-ops when heterogeneous mode is off):

- ``micro_step_begin`` at forward, ``micro_step_end`` after backward: this rank's compute time for
  its current micro-batch size (the device is synchronised at both ends, so it is the real time)
  and the activation bytes its forward saved; an emulated slow rank is slowed here, and a rank
  over its emulated memory fails as out of memory;
- ``step_end`` after the optimizer step: during the ``profile_steps`` first steps, the ranks pool
  their measurements, rank 0 fits ``time = a_i + b_i * mbs`` and the activation bytes per rank,
  derives each rank's memory limit, plans, the plan is broadcast, and every rank switches to it at
  this same step boundary (the sampler follows).

Any allocation gives the exact global-batch gradient (loss weighting), so profiling trains for
real: the steps spent measuring are ordinary training steps.
"""

import time

from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import logger

from . import comm_clock
from .batch import apply_plan, memory_capacities
from .emulation import scheduled_speed, start_emulation
from .memory import (ActivationMeter, RankCannotFitError, fit_activation_model, max_micro_batch, model_state_bytes,
                     optimizer_state_bytes)
from .planner import Plan, TimeModel, fit_time_model, plan_micro_batches, plausible_time_model
from .rebalance import RebalanceEvent, RebalancePolicy


class PlanAgreementError(RuntimeError):
    """A peer failed while the ranks were agreeing on a plan."""


class EmulatedOutOfMemoryError(RuntimeError):
    """A rank of an emulated cluster needed more than its emulated memory (``emulation.memory_gb``)."""


class HeterogeneousRuntime:

    def __init__(self, engine):
        self.engine = engine
        self.config = engine._config
        self.state = self.config.heterogeneous
        self.settings = self.state.settings.config
        self.rank = self.state.dp_rank
        # Measurements are pooled and the plan decided over the whole world: with model
        # parallelism, the members of one data-parallel replica must run the same plan, and the
        # slowest member sets the replica's pace.
        self.emulator = start_emulation(self.settings.emulation, self.rank)
        self.steps = 0
        self.profiling = self.settings.load_balancing_strategy == "compute_aware" and self.settings.profile_steps > 0
        self.history = []  # per finished step: every rank's [(mbs, seconds, activation bytes), ...]
        self._current = []
        self._began = None
        self.loaders = []
        self.capacities = memory_capacities(self.state)
        emulation = self.settings.emulation
        # Only an emulated capacity is enforced here; a real device enforces its own.
        self.emulated_capacity = self.capacities[self.rank] if emulation is not None and emulation.memory_gb else None
        self.meter = ActivationMeter()
        self._state_bytes = None
        self.gas_origin = 0  # the engine's micro-step count when this rank's current gas took effect
        self._backward_done = None
        self._forward_s = None
        self._split = []  # (forward, backward) own seconds per micro-step, while recording
        scheduler = self.settings.scheduler
        self.dynamic = scheduler.dynamic_rebalancing and self.settings.load_balancing_strategy == "compute_aware"
        self.policy = RebalancePolicy(scheduler.imbalance_threshold, scheduler.cooldown_checks) if self.dynamic else None
        self.events = []  # RebalanceEvent per plan change after profiling (every rank keeps them)
        self.reference_models = None  # rank 0: the time models that chose the plan in force
        self.baseline = None  # rank 0: per-rank time per micro-step in the plan's first interval
        self.recording = False  # per-step records for the heterogeneous profiler
        self.records = []
        self._window = []  # this rank's steps since the last rebalancing check
        self._last_step_end = (time.perf_counter(), comm_clock.seconds_in_collectives())
        self._apply_speed_schedule(1)
        self.log_plan("plan at start-up", self.plan)

    @property
    def plan(self):
        return self.state.plan

    @property
    def emulation_mode(self):
        return self.emulator.mode if self.emulator is not None else "none"

    def log_plan(self, title, plan):
        if dist.get_rank() == 0:
            names = [d.name for d in self.state.devices or []] or None
            logger.info(f"deepspeed-hetero {title} (strategy {plan.strategy}):\n{plan.format_table(names)}")

    # -- hooks --------------------------------------------------------------------------------

    @property
    def timing(self):
        """Micro-steps are timed (with a device synchronisation at both ends) only while profiling or
        when time dilation needs the compute time; otherwise the hooks cost nothing."""
        return (self.profiling or self.dynamic or self.recording
                or (self.emulator is not None and self.emulator.mode == "dilation"))

    @property
    def measuring_memory(self):
        """Activation bytes are counted while profiling with known capacities, or on a rank whose
        emulated memory is enforced after profiling."""
        return ((self.profiling and self.capacities is not None) or self.emulated_capacity is not None
                or self.recording)

    def micro_step_begin(self):
        if self.measuring_memory:
            self.meter.start()
        if not self.timing:
            return
        get_accelerator().synchronize()
        self._began = (time.perf_counter(), comm_clock.seconds_in_collectives())
        self._forward_s = None

    def backward_begin(self):
        """engine.backward() starts: the forward part of the micro-step ends here (recorded only;
        a torch-style loss.backward() leaves forward and backward as one span)."""
        if self._began is None or not self.recording:
            return
        get_accelerator().synchronize()
        began, in_collectives = self._began
        self._forward_s = time.perf_counter() - began - (comm_clock.seconds_in_collectives() - in_collectives)

    def micro_step_end(self):
        """This rank's own time for the micro-step: wall time minus time inside collectives, where
        a fast rank waits for slower peers."""
        activations = self.meter.stop() if self.meter.active else None
        if activations is not None:
            self._check_emulated_memory(activations)
        if self._began is None:  # backward without forward through the engine, or not timing
            return
        get_accelerator().synchronize()
        began, in_collectives = self._began

        def own_time():
            return time.perf_counter() - began - (comm_clock.seconds_in_collectives() - in_collectives)

        if self.emulator is not None:
            self.emulator.after_compute(own_time())
        # Measured after the emulated slow-down: the planner must see the slowed device.
        own = max(own_time(), 1e-9)
        self._current.append((self.config.train_micro_batch_size_per_gpu, own, activations))
        if self.recording:
            forward = own if self._forward_s is None else min(max(self._forward_s, 0.0), own)
            self._split.append((forward, own - forward))
        self._began = None
        self._backward_done = (time.perf_counter(), comm_clock.seconds_in_collectives())

    def _step_overhead(self):
        """This rank's own time from the end of the last backward to here (the optimizer step and
        the boundary's bookkeeping), less its time in collectives; 0 when not timed."""
        if self._backward_done is None:
            return 0.0
        get_accelerator().synchronize()
        began, in_collectives = self._backward_done
        self._backward_done = None
        return max(time.perf_counter() - began - (comm_clock.seconds_in_collectives() - in_collectives), 0.0)

    def _check_emulated_memory(self, activations):
        if self.emulated_capacity is None or self.profiling:
            return  # the profiling steps measure what the plan must fit; the plan is enforced after
        needed = self.model_state_bytes() + activations
        if needed > self.emulated_capacity:
            gib = 2.0**30
            raise EmulatedOutOfMemoryError(
                f"deepspeed-hetero emulation: data-parallel rank {self.rank} is out of memory: micro-batch "
                f"{self.config.train_micro_batch_size_per_gpu} needs {needed / gib:.4g} GiB (model state "
                f"{self.model_state_bytes() / gib:.4g} GiB + activations {activations / gib:.4g} GiB), its emulated "
                f"capacity is {self.emulated_capacity / gib:.4g} GiB (heterogeneous_config.emulation.memory_gb)")

    def model_state_bytes(self):
        """This rank's predicted model-state bytes (its ZeRO shard), computed once."""
        if self._state_bytes is None:
            engine = self.engine
            params = [p for p in engine.module.parameters() if p.requires_grad]
            count = sum(getattr(p, "ds_numel", p.numel()) for p in params)
            half = engine.fp16_enabled() or engine.bfloat16_enabled()
            optimizer = engine.basic_optimizer if engine.basic_optimizer is not None else engine.optimizer
            self._state_bytes = model_state_bytes(count, int(engine.zero_optimization_stage()),
                                                  self.plan.world_size, param_bytes=2 if half else 4,
                                                  optimizer_bytes=optimizer_state_bytes(optimizer),
                                                  master_bytes=4 if half else 0,
                                                  optimizer_offloaded=engine.zero_use_cpu_optimizer())
        return self._state_bytes

    def step_end(self):
        self.steps += 1
        mine, self._current = self._current, []
        overhead = self._step_overhead()
        now = (time.perf_counter(), comm_clock.seconds_in_collectives())
        wall, in_collectives = now[0] - self._last_step_end[0], now[1] - self._last_step_end[1]
        self._last_step_end = now
        split, self._split = self._split, []
        if self.recording:
            self._record(mine, split, overhead, wall, in_collectives)
        self._apply_speed_schedule(self.steps + 1)
        if self.profiling:
            self._profiling_step(mine, overhead)
        elif self.dynamic:
            self._window.append({"samples": mine, "step_overhead": overhead, "wall": wall})
            # A check needs a whole interval at the plan in force (the same on every rank: the
            # window restarts at the end of profiling and at every check).
            if len(self._window) >= self.settings.scheduler.check_interval:
                self._check_rebalance()

    def start_recording(self):
        """Record every step from the next one on (the heterogeneous profiler); the first record's
        wall time starts now, not at the last step end (anything done in between is not a step)."""
        self.records = []
        self._split = []
        self.recording = True
        self._last_step_end = (time.perf_counter(), comm_clock.seconds_in_collectives())

    def stop_recording(self):
        self.recording = False
        return list(self.records)

    def _apply_speed_schedule(self, step):
        speed = scheduled_speed(self.settings.emulation, self.rank, step) if self.emulator is not None else None
        if speed is not None and speed != self.emulator.speed:
            self.emulator.set_speed(speed)
            logger.info(f"deepspeed-hetero emulation: rank {self.rank} runs at speed {speed} from step {step} "
                        f"({self.emulator.mode})")

    def _record(self, micro_steps, split, overhead, wall, in_collectives):
        activations = [b for _, _, b in micro_steps if b is not None]
        self.records.append({
            "step": self.steps,
            "micro_batch_size": self.config.train_micro_batch_size_per_gpu,
            "samples": sum(m for m, _, _ in micro_steps),
            "compute_s": sum(t for _, t, _ in micro_steps),
            "forward_s": sum(f for f, _ in split),
            "backward_s": sum(b for _, b in split),
            "optimizer_s": overhead,
            "collective_s": in_collectives,
            "wall_s": wall,
            "activation_bytes": max(activations) if activations else None,
        })

    def _profiling_step(self, mine, overhead):
        mine = {"dp_rank": self.rank, "samples": mine, "step_overhead": overhead,
                "state_bytes": self.model_state_bytes() if self.capacities else 0}
        everyone = _per_replica(self._gather(mine), self.plan.world_size)
        self.history.append(everyone)
        new_plan = self._agree(self._decide() if dist.get_rank() == 0 else None)
        if (new_plan.micro_batch_sizes, new_plan.gradient_accumulation_steps) != (
                self.plan.micro_batch_sizes, self.plan.gradient_accumulation_steps):
            self.switch_to(new_plan, f"plan after profiling step {self.steps}")
        if self.steps >= self.settings.profile_steps:
            self.profiling = False
            self._window = []

    # -- dynamic rebalancing ------------------------------------------------------------------

    def _window_entry(self):
        steps, self._window = self._window, []
        return {"dp_rank": self.rank, "samples": [s for step in steps for s in step["samples"]],
                "step_overhead": sum(step["step_overhead"] for step in steps) / max(len(steps), 1),
                "wall": sum(step["wall"] for step in steps) / max(len(steps), 1),
                "state_bytes": self.model_state_bytes() if self.capacities else 0}

    def _check_rebalance(self, on_demand=False, forced_models=None):
        """Every rank: pool the interval's measurements, let rank 0 decide, switch together."""
        everyone = _per_replica(self._gather(self._window_entry()), self.plan.world_size)
        box = None
        if dist.get_rank() == 0:
            box = self._decide_rebalance(everyone, on_demand, forced_models)
        box = self._broadcast(box)
        if "error" in box:
            raise ValueError(f"deepspeed-hetero: rebalancing at step {self.steps} failed: {box['error']}")
        if "plan" in box:
            new_plan = Plan.from_dict(box["plan"])
            old = self.plan
            self.switch_to(new_plan, f"rebalance at step {self.steps} ({box['reason']})")
            self.events.append(RebalanceEvent(self.steps, tuple(old.micro_batch_sizes),
                                              tuple(new_plan.micro_batch_sizes), box["gain"], box["wall"]))
        return self.plan

    def _decide_rebalance(self, everyone, on_demand=False, forced_models=None):
        try:
            wall = max(entry["wall"] for entry in everyone)
            self._observe_last_event(wall)
            plan = self.plan
            if forced_models is None and not on_demand:
                times = self._micro_step_times(everyone)
                if self.baseline is None:
                    self.baseline = times
                    if self.reference_models is None:  # no profiling steps: per-sample cost only
                        self.reference_models = [TimeModel(0.0, t / m) for t, m in zip(times, plan.micro_batch_sizes)]
                    return {"keep": "baseline of the plan in force measured", "gain": 0.0}
                models = [TimeModel(ref.a * t / base, ref.b * t / base)
                          for ref, t, base in zip(self.reference_models, times, self.baseline)]
            else:
                models = forced_models or self._window_models(everyone)
            current = max(g * model.micro_step_time(m) for model, m, g in zip(
                models, plan.micro_batch_sizes, plan.gradient_accumulation_steps))
            best = plan_micro_batches(models, train_batch_size=plan.train_batch_size,
                                      gradient_accumulation_steps=self.state.base_gas,
                                      strategy="compute_aware", max_micro_batch=self.memory_limits(),
                                      allow_per_rank_gas=self.per_rank_gas_allowed)
            if on_demand:
                gain = 1.0 - best.predicted_step_time / current if current > 0 else 0.0
                rebalance, reason = gain > 0, f"on demand, predicted gain {gain:.1%}"
            else:
                decision = self.policy.check(current, best.predicted_step_time)
                gain, rebalance, reason = decision.predicted_gain, decision.rebalance, decision.reason
            same = (best.micro_batch_sizes, best.gradient_accumulation_steps) == (
                plan.micro_batch_sizes, plan.gradient_accumulation_steps)
            if not rebalance or same:
                return {"keep": reason, "gain": gain}
            self.reference_models, self.baseline = models, None
            return {"plan": best.to_dict(), "reason": reason, "gain": gain, "wall": wall}
        except ValueError as exc:
            return {"error": str(exc)}

    def _micro_step_times(self, everyone):
        """Each rank's mean own time per micro-step at its size in the plan in force.

        Drift is measured against the first whole interval of a plan (the baseline), not against
        the models' predictions: an interval runs one size per rank, which cannot separate a
        rank's fixed cost from its per-sample cost, and a prediction error of the profiled fit at
        that size would read as drift. A device that slows down (throttling, a neighbour) slows
        all of its compute, so the models that chose the plan are scaled by time / baseline: 1
        for every rank when nothing changed, whatever the split, so noise alone predicts no gain."""
        times = []
        for entry, size in zip(everyone, self.plan.micro_batch_sizes):
            at_size = [t for m, t in (s[:2] for s in entry["samples"]) if m == size] or [
                t for _, t in (s[:2] for s in entry["samples"])]
            times.append(sum(at_size) / len(at_size))
        return times

    def _window_models(self, everyone):
        """Per-rank models for an on-demand re-plan: the profiled models scaled by measured /
        predicted time over the interval (see ``_micro_step_times`` for why a and b are not
        refitted from one size)."""
        gas = self.state.base_gas
        models = []
        for rank, entry in enumerate(everyone):
            samples = [s[:2] for s in entry["samples"]]
            base = self.base_models[rank] if getattr(self, "base_models", None) else fit_time_model(samples)
            drift = sum(t for _, t in samples) / sum(base.micro_step_time(m) for m, _ in samples)
            models.append(TimeModel(drift * base.a + entry["step_overhead"] / gas, drift * base.b))
        return models

    def _observe_last_event(self, wall):
        """Log the observed gain of the last rebalance once an interval ran with its plan."""
        event = self.events[-1] if self.events else None
        if event is not None and event.step_time_after is None and event.step < self.steps:
            event.step_time_after = wall
            logger.info(f"deepspeed-hetero rebalance at step {event.step}: predicted gain "
                        f"{event.predicted_gain:.1%}, observed {event.observed_gain:.1%} (step time "
                        f"{event.step_time_before:.4g} s -> {wall:.4g} s)")

    def reschedule(self, utilization_metrics=None):
        """Re-plan now (every rank calls this at the same step boundary), from ``utilization_metrics``
        (per-rank busy seconds per step: a list, a dict with ``busy_seconds``, or the heterogeneous
        profiler's ``get_metrics()``) or, without them, from the steps since the last check."""
        forced = None
        if utilization_metrics is not None:
            busy = utilization_metrics
            if isinstance(busy, dict):  # {"busy_seconds": [...]} or HeterogeneousProfiler.get_metrics()
                busy = busy["busy_seconds"] if "busy_seconds" in busy else [
                    rank["busy_s_per_step"] for rank in busy.get("ranks", ())]
            busy = [float(b) for b in busy]
            plan = self.plan
            if len(busy) != plan.world_size or not all(b > 0 for b in busy):
                raise ValueError(f"reschedule_workload: utilization_metrics needs one positive busy time per "
                                 f"data-parallel rank ({plan.world_size}), got {busy}")
            forced = [TimeModel(0.0, b / n) for b, n in zip(busy, plan.samples_per_rank)]
        elif not self._window:
            raise ValueError("reschedule_workload: no step was measured since the last check; pass "
                             "utilization_metrics (per-rank busy seconds) or train some steps first")
        return self._check_rebalance(on_demand=True, forced_models=forced)

    # -- planning -----------------------------------------------------------------------------

    def measured_time_models(self):
        """Per-rank fits; the first step is left out once later ones exist (it carries warm-up). A
        fit whose fixed cost is most of a micro-step falls back to proportional time."""
        steps = self._fit_steps()
        gas = self.state.base_gas
        models = []
        self.base_models = []  # the fits alone: what dynamic rebalancing measures drift against
        for rank in range(len(steps[0])):
            samples = [sample[:2] for step in steps for sample in step[rank]["samples"]]
            # A nearly flat fit is noise, not a fixed cost (see plausible_time_model).
            fit = fit_time_model(samples)  # raises a clear ValueError without samples
            model = plausible_time_model(fit, sum(m for m, _ in samples) / len(samples))
            self.base_models.append(model)
            # The optimizer step runs once per step on every rank, at the rank's own speed: a slow
            # rank's is longer, and the others wait for it at the next collective. Spread over the
            # micro-steps, it is part of the fixed cost a that the planner balances.
            overhead = sum(step[rank]["step_overhead"] for step in steps) / len(steps)
            models.append(TimeModel(model.a + overhead / gas, model.b))
        return models

    def memory_limits(self):
        """Per-rank micro-batch limits from the measured activations, or None without capacities.

        Every profiling step counts (the bytes a forward saves do not warm up). Raises
        RankCannotFitError naming a rank that cannot hold one sample.
        """
        if self.capacities is None:
            return None
        names = [d.name for d in self.state.devices]
        utilization = self.state.settings.memory.hbm_utilization_threshold
        limits = []
        for rank, capacity in enumerate(self.capacities):
            measured = [(m, b) for step in self.history for m, _, b in step[rank]["samples"] if b is not None]
            state = self.history[-1][rank]["state_bytes"]
            limits.append(None if capacity is None or not measured else max_micro_batch(
                capacity, state, fit_activation_model(measured), utilization, f"data-parallel rank {rank} ({names[rank]})"))
        return limits

    def _fit_steps(self):
        return self.history[1:] if len(self.history) > 1 else self.history

    def _replan(self):
        plan = self.plan
        models = self.measured_time_models()
        self.reference_models, self.baseline = models, None  # what dynamic rebalancing scales
        gas = self.state.base_gas
        caps = self.memory_limits()
        best = plan_micro_batches(models, train_batch_size=plan.train_batch_size, gradient_accumulation_steps=gas,
                                  strategy="compute_aware", max_micro_batch=caps,
                                  allow_per_rank_gas=self.per_rank_gas_allowed)
        if caps is not None:
            shown = ["-" if cap is None else cap for cap in caps]
            best = Plan(**{**best.to_dict(), "notes": list(best.notes) + [f"memory limits (samples per micro-step, "
                                                                          f"per rank): {shown}"]})
        if self.steps >= self.settings.profile_steps or set(best.gradient_accumulation_steps) != {gas}:
            return best
        # Fitting a + b * mbs needs sizes far enough apart per rank: sizes one sample apart leave
        # the split between fixed and per-sample cost to noise, and a model scaled later (dynamic
        # rebalancing) or used far from those sizes then misplaces work. A rank whose timed sizes
        # span less than a quarter of its size trades that many samples with its neighbour for
        # the next profiling step (any split is exact).
        sizes, seen = list(best.micro_batch_sizes), self._sizes_seen()
        for left in range(0, len(sizes) - 1, 2):
            pair = (left, left + 1)
            if all(_spread(seen[r] | {sizes[r]}) >= _wanted_spread(sizes[r]) for r in pair):
                continue
            big, small = sorted(pair, key=lambda r: (-sizes[r], r))
            delta = min(_wanted_spread(sizes[big]), sizes[big] - 1)
            if caps is not None and caps[small] is not None:
                delta = min(delta, caps[small] - sizes[small])
            if delta > 0:
                sizes[big] -= delta
                sizes[small] += delta
        if sizes == list(best.micro_batch_sizes):
            return best
        return plan_micro_batches(models, train_batch_size=plan.train_batch_size, gradient_accumulation_steps=gas,
                                  strategy="manual", manual=sizes)

    @property
    def per_rank_gas_allowed(self):
        """ZeRO-0/1 reduce gradients only at the accumulation boundary, so ranks may run different
        numbers of micro-steps; ZeRO-2/3 reduce every micro-step and need equal gas. An optimizer
        offloaded to the host sizes its accumulation buffers by the gas at start-up."""
        return int(self.engine.zero_optimization_stage()) <= 1 and not self.engine.zero_use_cpu_optimizer()

    def _sizes_seen(self):
        """Sizes each rank was timed at in the steps the fit uses (the warm-up step is not one)."""
        steps = self.history[1:]
        return [{sample[0] for step in steps for sample in step[rank]["samples"]} for rank in range(self.plan.world_size)]

    def switch_to(self, plan, reason):
        """Adopt ``plan`` from the next step on (every rank calls this at the same boundary)."""
        old = self.plan
        apply_plan(self.config, plan)
        if plan.gradient_accumulation_steps[self.rank] != old.gradient_accumulation_steps[self.rank]:
            # The engine finds the accumulation boundary by counting micro-steps from here on.
            self.gas_origin = self.engine.micro_steps + 1
        gas = list(plan.gradient_accumulation_steps) if plan.per_rank_gas else None
        for sampler in self.loaders:
            sampler.set_micro_batch_sizes(list(plan.micro_batch_sizes), gradient_accumulation_steps=gas)
        if dist.get_rank() == 0:
            logger.info(f"deepspeed-hetero {reason}: micro-batches {list(old.micro_batch_sizes)} -> "
                        f"{list(plan.micro_batch_sizes)}, gas {list(old.gradient_accumulation_steps)} -> "
                        f"{list(plan.gradient_accumulation_steps)}, predicted step time "
                        f"{old.predicted_step_time:.4g} s -> {plan.predicted_step_time:.4g} s")
            self.log_plan(reason, plan)

    # -- collectives (the edges) --------------------------------------------------------------

    def _gather(self, samples):
        gathered = [None] * dist.get_world_size()
        try:
            dist.all_gather_object(gathered, samples)
        except Exception as exc:
            raise PlanAgreementError(f"deepspeed-hetero: data-parallel rank {self.rank} could not gather the "
                                     f"measurements of step {self.steps} to agree on a plan; a peer rank failed or "
                                     f"timed out ({exc})") from exc
        return gathered

    def _decide(self):
        """Rank 0's new plan, or the reason there is none (sent to every rank, which all stop)."""
        try:
            return self._replan()
        except ValueError as exc:  # the planner's and the memory model's errors say what to change
            return exc

    def _broadcast(self, box):
        box = [box]
        try:
            dist.broadcast_object_list(box, src=0)
        except Exception as exc:
            raise PlanAgreementError(f"deepspeed-hetero: data-parallel rank {self.rank} did not receive the "
                                     f"rebalancing decision from rank 0; rank 0 failed or timed out ({exc})") from exc
        return box[0]

    def _agree(self, decision):
        box = [decision.to_dict() if isinstance(decision, Plan) else None if decision is None else {"error": str(decision)}]
        try:
            dist.broadcast_object_list(box, src=0)
        except Exception as exc:
            raise PlanAgreementError(f"deepspeed-hetero: data-parallel rank {self.rank} did not receive the new "
                                     f"plan from rank 0; rank 0 failed or timed out ({exc})") from exc
        if "error" in box[0]:
            raise ValueError(f"deepspeed-hetero: no plan fits after profiling step {self.steps}: {box[0]['error']}")
        return Plan.from_dict(box[0])

    def close(self):
        self.meter.stop()
        if self.emulator is not None:
            self.emulator.close()


def _spread(sizes):
    return max(sizes) - min(sizes)


def _wanted_spread(size):
    """How far apart the profiled sizes of a rank running ``size`` should be: a quarter of it."""
    return max(1, size // 4)


def _per_replica(gathered, data_parallel_size):
    """One entry per data-parallel rank from every process's measurements: the members of a
    replica (model-parallel peers) ran the same micro-steps; each micro-step counts at its slowest
    member's time and largest activation bytes."""
    replicas = [[entry for entry in gathered if entry["dp_rank"] == rank] for rank in range(data_parallel_size)]
    merged = []
    for rank, members in enumerate(replicas):
        if not members or len({len(m["samples"]) for m in members}) != 1:
            raise PlanAgreementError(f"deepspeed-hetero: the model-parallel members of data-parallel rank {rank} "
                                     f"reported different micro-steps ({[len(m['samples']) for m in members]}); "
                                     f"they must run the same plan")
        samples = []
        for steps in zip(*(m["samples"] for m in members)):
            sizes = {size for size, _, _ in steps}
            if len(sizes) != 1:
                raise PlanAgreementError(f"deepspeed-hetero: the model-parallel members of data-parallel rank {rank} "
                                         f"ran different micro-batch sizes {sorted(sizes)}")
            activations = [b for _, _, b in steps if b is not None]
            samples.append((sizes.pop(), max(t for _, t, _ in steps), max(activations) if activations else None))
        merged.append({"samples": samples, "step_overhead": max(m["step_overhead"] for m in members),
                       "state_bytes": max(m["state_bytes"] for m in members),
                       "wall": max(m.get("wall", 0.0) for m in members)})
    return merged
