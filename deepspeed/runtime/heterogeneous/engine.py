# SPDX-License-Identifier: Apache-2.0
"""What ``DeepSpeedEngine`` gains from the fork: the plan in force and its scheduling API.

The engine inherits ``HeterogeneousEngineMixin``; every method is a thin view over the pure
planner (``planning/planner.py``) and the fork's state (``state.py``, ``engine._config.heterogeneous``).
"""

import weakref

import torch

from .measure.devices import DeviceDescription, normalize_scores
from .planning.planner import device_score, distribute_workload, schedule_heterogeneous_tasks

_ENGINES = weakref.WeakSet()
"""Every live engine: the heterogeneous profiler finds the engine of a module here."""


def engine_of(module):
    """The live engines whose ``.module`` is ``module``."""
    return [engine for engine in list(_ENGINES) if getattr(engine, "module", None) is module]


class HeterogeneousEngineMixin:
    """Heterogeneous-training view of a ``DeepSpeedEngine`` (all methods read ``self._config``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _ENGINES.add(self)

    @property
    def heterogeneous_state(self):
        """The fork's state (``HeterogeneousState``), also when the fork is off."""
        return self._config.heterogeneous

    @property
    def heterogeneous_plan(self):
        """The plan in force (per-rank micro-batches, gas, predicted times), or None when disabled."""
        return self._config.heterogeneous.plan

    @property
    def heterogeneous_devices(self):
        """Every data-parallel rank's DeviceDescription as gathered at start-up (None if not needed)."""
        return self._config.heterogeneous.devices

    def _get_device_score(self, device):
        """Prior speed of ``device`` (a DeviceDescription or its dict) in TFLOP/s."""
        return device_score(device)

    def _normalize_scores(self, scores):
        """Scores scaled to sum to 1."""
        return normalize_scores(scores)

    def _distribute_workload(self, normalized_scores):
        """Per-rank micro-batch sizes for ranks of relative speeds ``normalized_scores``, for this
        engine's global batch and gradient accumulation: the compute_aware split (the slowest
        rank's time per micro-step least, a tie to the lower rank); exact integer sum."""
        return distribute_workload(normalized_scores, self.train_batch_size(), self._plan_gas())

    def schedule_heterogeneous_tasks(self, devices):
        """A plan for ``devices`` (DeviceDescriptions or dicts, one per data-parallel rank) from their
        prior scores, for this engine's global batch; it does not change the plan in force."""
        devices = [d if isinstance(d, DeviceDescription) else DeviceDescription.from_dict(d) for d in devices]
        return schedule_heterogeneous_tasks(devices, self.train_batch_size(), self._plan_gas())

    def reschedule_workload(self, utilization_metrics=None):
        """Re-plan the work split now, on every rank at the same step boundary (a collective).

        Args:
            utilization_metrics: per-rank busy seconds per optimizer step, as a list in
                data-parallel rank order or a dict with ``busy_seconds`` (what
                ``HeterogeneousProfiler`` measures); None: the steps measured since the last check.

        Returns the plan in force afterwards; it changes when the new split is predicted faster.
        """
        runtime = self._heterogeneous_runtime()
        if runtime is None:
            raise RuntimeError("reschedule_workload() needs heterogeneous_config enabled")
        if self._config.heterogeneous.pipeline is not None:
            raise RuntimeError("reschedule_workload() is not supported with a PipelineModule: the pipeline engine fixes "
                               "each replica's micro-batches when it starts, so the replicas keep their start-up plan")
        return runtime.reschedule(utilization_metrics)

    def _heterogeneous_eval_sampler(self, dataset, route, data_sampler):
        """``deepspeed_io``'s sampler for an evaluation or prediction loader in the low-communication
        mode: every rank one shard of the world's (upstream would pair the host's size with the
        global rank); else ``data_sampler`` as given."""
        from deepspeed import comm as dist
        from deepspeed.runtime.constants import ROUTE_EVAL, ROUTE_PREDICT
        if (data_sampler is not None or route not in (ROUTE_EVAL, ROUTE_PREDICT)
                or self._config.heterogeneous.low_communication is None):
            return data_sampler
        return torch.utils.data.DistributedSampler(dataset, num_replicas=dist.get_world_size(), rank=dist.get_rank(),
                                                   shuffle=False)

    def synchronise_replicas(self):
        """``communication.mode: "low_communication"``: synchronise the hosts' replicas now (the outer
        step, with the samples since the last one), e.g. before exporting the model; every rank calls
        it at the same step boundary (a collective). Returns the number of synchronisations so far."""
        low = self._config.heterogeneous.low_communication
        if low is None:
            raise RuntimeError("synchronise_replicas() needs heterogeneous_config.communication.mode "
                               "\"low_communication\"; in mode \"exact\" every rank holds the same model")
        if low.inner_steps:
            low.synchronise()
        return low.synchronisations

    def _heterogeneous_refuse(self, method):
        if self.heterogeneous_plan is not None:
            raise RuntimeError(f"{method}() is not supported with heterogeneous_config enabled: every rank's "
                               "micro-batch comes from the plan; change train_batch_size in the config instead")

    # -- hooks the engine calls (no-ops when the fork is off) ---------------------------------

    def _heterogeneous_start_runtime(self):
        """The engine's construction calls this on every rank, before it builds any loader: the
        runtime controller is created here, and with it every collective its construction runs
        (the emulation's speed check). Never later, at a hook: some ranks reach a hook first (a
        pipeline's later stages run their first forward only once the earlier stages' activations
        arrive), and a collective there would wait for ranks that wait for it."""
        state = self._config.heterogeneous
        if state.plan is not None and state.runtime is None:
            from .runtime import HeterogeneousRuntime
            state.runtime = HeterogeneousRuntime(self)

    def _heterogeneous_destroy(self):
        """``engine.destroy()`` calls this first: what the fork started for this engine ends here, on
        every rank alike: the runtime controller closes (the meter, the emulation's cgroups and speed
        limits, the collective clock's settings), and the engine's communication session closes
        (``comm/session.py``: its overlap worker joined, its process groups destroyed, its hooks
        removed). Once; a second call finds nothing left."""
        state = self._config.heterogeneous
        runtime, state.runtime = state.runtime, None
        try:
            if runtime is not None:
                runtime.close()
        finally:
            from .comm.session import close_engine_session
            close_engine_session(self)

    def _heterogeneous_runtime(self):
        """The runtime controller ``_heterogeneous_start_runtime`` created; None when the fork is off.
        Never created here: a collective of its construction would run where only this rank is."""
        state = self._config.heterogeneous
        if state.plan is None:
            return None
        if state.runtime is None:
            raise RuntimeError("deepspeed-hetero: the runtime controller is created as the engine starts "
                               "(_heterogeneous_start_runtime), on every rank; this engine has none")
        return state.runtime

    def _heterogeneous_micro_step_begin(self, inputs=(), kwargs=None):
        """A training forward begins (one with autograd on: evaluation forwards are neither timed
        nor checked); ``inputs``/``kwargs`` are forward's arguments, whose batch size is checked
        against the plan, or re-split into it. Returns the ``(inputs, kwargs)`` to compute."""
        runtime = self._heterogeneous_runtime()
        if runtime is not None and torch.is_grad_enabled():
            return runtime.micro_step_begin(inputs, kwargs)
        return inputs, kwargs

    def _heterogeneous_forward_end(self, outputs):
        """The forward's outputs as the caller gets them (returned to the ranks fed their samples
        after a re-split)."""
        runtime = self._heterogeneous_runtime()
        if runtime is not None and torch.is_grad_enabled():
            return runtime.forward_end(outputs)
        return outputs

    def wait_for_parameters(self):
        """With ``communication.overlap_parameter_gather``: wait until the parameters the last step
        updated are current on this rank (the next forward waits module by module on its own; code
        that reads parameters between ``step()`` and the next forward calls this first). A no-op
        otherwise."""
        from .comm import parameter_gather
        parameter_gather.wait_all(getattr(self, "optimizer", None))

    def _heterogeneous_backward_begin(self, loss=None):
        self.wait_for_parameters()  # parameters the forward did not reach
        runtime = self._heterogeneous_runtime()
        if runtime is not None:
            runtime.backward_begin(loss)

    def _heterogeneous_micro_step_end(self):
        runtime = self._heterogeneous_runtime()
        if runtime is not None:
            runtime.micro_step_end()

    def _heterogeneous_step_end(self):
        runtime = self._heterogeneous_runtime()
        if runtime is not None:
            runtime.step_end()

    def _heterogeneous_step_done(self):
        """``step()`` is complete (the end of upstream's step): a periodic checkpoint may be due."""
        runtime = self._config.heterogeneous.runtime
        if runtime is not None:
            runtime.step_done()

    def _heterogeneous_gas_origin(self):
        """The micro-step count at which this rank's current gas took effect (0 unless a plan changed
        it mid-training): accumulation boundaries are counted from there."""
        runtime = self._config.heterogeneous.runtime
        return 0 if runtime is None else runtime.gas_origin

    def _heterogeneous_train_loader(self, dataset, data_parallel_rank, collate_fn, pin_memory=False,
                                    num_workers=None):
        """The loader ``deepspeed.initialize(training_data=...)`` returns in heterogeneous mode: rank r
        gets its mbs_r of every sum(mbs) samples, and a new plan applies from the next step.

        ``num_workers`` (deepspeed_io's ``num_local_io_workers``; None: load in the main process)
        and ``pin_memory`` pass through; workers load one optimizer step's micro-batches at a time
        (see ``loader.py``)."""
        from deepspeed.accelerator import get_accelerator
        from .data.loader import HeterogeneousDataLoader
        if self.curriculum_learning_enabled():
            raise ValueError("heterogeneous_config.enabled does not support data_efficiency curriculum learning: "
                             "its sampler sets every rank's batch size itself, the plan sets per-rank ones. "
                             "Disable one of them")
        # In order for a pipeline, as upstream's pipeline engine reads its training data.
        shuffle = not getattr(self, "pipeline_parallelism", False)
        batch_sampler = self.heterogeneous_sampler(dataset, shuffle=shuffle, drop_last=self.dataloader_drop_last())
        self._heterogeneous_runtime().feeding.engine_loader = True
        return HeterogeneousDataLoader(dataset, batch_sampler, collate_fn=collate_fn, tput_timer=self.tput_timer,
                                       num_workers=num_workers or 0,
                                       pin_memory=pin_memory and get_accelerator().device_name() != "cpu",
                                       micro_batches_per_step=self.gradient_accumulation_steps)

    # -- users' own loaders -------------------------------------------------------------------

    def heterogeneous_sampler(self, dataset, shuffle=True, seed=0, drop_last=False):
        """A batch sampler that feeds this rank its planned micro-batches of ``dataset`` and follows
        every plan change (it is registered with the engine).

        Use it as ``DataLoader(dataset, batch_sampler=engine.heterogeneous_sampler(dataset))`` (no
        ``batch_size``/``shuffle``/``drop_last`` on the DataLoader). Rank r takes its mbs_r of
        every sum(mbs) samples of an epoch's permutation (seeded with ``seed + epoch``; call
        ``set_epoch`` each epoch). A plan change applies from the first round the loader has not
        fetched yet, so give the DataLoader ``num_workers=0`` (workers fetch ahead and would feed
        the old sizes after a change, which the engine's batch check refuses).
        """
        from .data.sampler import HeterogeneousBatchSampler
        plan = self._require_plan("heterogeneous_sampler")
        sampler = HeterogeneousBatchSampler(dataset, list(plan.micro_batch_sizes), rank=self.heterogeneous_state.dp_rank,
                                            shuffle=shuffle, seed=seed, drop_last=drop_last,
                                            gradient_accumulation_steps=list(plan.gradient_accumulation_steps)
                                            if plan.per_rank_gas else None)
        return self.register_heterogeneous_sampler(sampler)

    def register_heterogeneous_sampler(self, sampler):
        """Make ``sampler`` (a ``HeterogeneousBatchSampler`` of this rank, e.g. built before the
        engine existed) follow the plan in force from its next round and every later change.
        Returns ``sampler``."""
        from .data.sampler import HeterogeneousBatchSampler
        plan = self._require_plan("register_heterogeneous_sampler")
        if not isinstance(sampler, HeterogeneousBatchSampler):
            raise TypeError(f"register_heterogeneous_sampler() takes a HeterogeneousBatchSampler, got "
                            f"{type(sampler).__name__}: a plan change must reach a running loader, which only a batch "
                            f"sampler allows (a DataLoader's batch_size is fixed); use "
                            f"DataLoader(dataset, batch_sampler=engine.heterogeneous_sampler(dataset))")
        rank = self.heterogeneous_state.dp_rank
        if sampler.num_replicas != plan.world_size or sampler.rank != rank:
            raise ValueError(f"register_heterogeneous_sampler(): the sampler is for rank {sampler.rank} of "
                             f"{sampler.num_replicas} data-parallel ranks, this engine is rank {rank} of "
                             f"{plan.world_size}")
        gas = list(plan.gradient_accumulation_steps) if plan.per_rank_gas else None
        if (tuple(sampler.micro_batch_sizes), tuple(sampler.gradient_accumulation_steps)) != (
                tuple(plan.micro_batch_sizes), tuple(gas or [1] * plan.world_size)):
            sampler.set_micro_batch_sizes(list(plan.micro_batch_sizes), gradient_accumulation_steps=gas)
        runtime = self._heterogeneous_runtime()
        if not any(s is sampler for s in runtime.feeding.samplers):
            runtime.feeding.samplers.append(sampler)
            # A checkpoint loaded before this sampler existed (the Trainer loads it before training
            # begins): it resumes at the position saved for the sampler registered in its place.
            runtime.feeding.restore_deferred_sampler(sampler, len(runtime.feeding.samplers) - 1)
        return sampler

    def _require_plan(self, method):
        if self.heterogeneous_plan is None:
            raise RuntimeError(f"{method}() needs heterogeneous_config.enabled: true (without it every rank takes "
                               f"train_micro_batch_size_per_gpu samples; use torch's DistributedSampler)")
        return self.heterogeneous_plan

    def _plan_gas(self):
        return self._config.heterogeneous.base_gas or self.gradient_accumulation_steps()
