# SPDX-License-Identifier: Apache-2.0
"""Adaptive fp16 loss scaling (deepspeed-hetero, docs/precision.md, "Adaptive loss scaling").

Upstream's dynamic scaler doubles the scale every ``loss_scale_window`` clean steps whatever the
gradients look like, so it keeps climbing into overflows, skipping a step and halving each
time, and it sits far below the range fp16 could use after a back-off. The adaptive scaler looks
at the gradients instead: after every step it knows the largest absolute value of the un-scaled
gradient over all ranks, and picks the next scale, a power of two, so that the scaled gradients
would use about ``auto_scale_threshold`` of fp16's range::

    scale = 2 ** floor(log2(threshold * 65504 / (peak * margin))),  peak = max of the last HISTORY max-abs values

Taking the peak of a short history keeps one quiet step from raising the scale into the next
ordinary one. An overflow still skips the step and halves the scale for the next one (the safety
net). What it teaches is bounded, so that overflows every few hundred steps cannot ratchet the
scale down to the minimum: the backward's largest value (an activation gradient, a spike of one
batch) exceeded what the measured peak predicted, and a safety ``margin``, a power of two, covers
that:

- the first overflow sets the margin to 2 (one halving), kept for ``MARGIN_DECAY_WINDOWS``
  loss-scale windows of clean steps: cheap insurance against an unseen factor that recurs every few
  dozen steps. A lone overflow at a margin that has held a while is a spike: it only restarts that;
- an overflow within ``OVERFLOW_BURST_STEPS`` clean steps of the previous one or of a margin change
  proves the margin short: it doubles. Those extra levels are halved after ``recovery_steps`` clean
  steps, which start at ``MARGIN_RECOVERY_STEPS``, double each time a lowered margin overflows that
  soon (a systematic factor) and halve when it holds that long (a burst of spikes).

Without a measurement to compare with (the initial scale, all-zero gradients), an overflow only
proves that the un-scaled max-abs was over ``65504 / scale``: that bound enters the history, so the
scale does not climb straight back while it is in the window.

Every rank ends with the same scale: the optimizers reduce the max-abs with MAX across the
data-parallel (and model-parallel) groups in the same collective as the overflow flag
(``overflow_and_max_abs`` below builds the tensor they reduce).

ZeRO-1/2 with ``offload_optimizer`` keeps no gradient partition on the device: its ranks measure
the fp32 partitions on the host (``zero_partition_gradients``), so ranks with and without offload
reduce the same ``[overflow, max-abs]``.
"""

import copy
import math
from collections import deque

import torch

from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
from deepspeed.utils import logger

FP16_MAX = float(torch.finfo(torch.float16).max)  # 65504
HISTORY = 8
"""Steps whose max-abs the next scale must accommodate."""
MAX_SCALE = 2.0**24
"""Upper bound of the scale: beyond it a tiny gradient would only buy fp32 overflow risk."""
MARGIN_DECAY_WINDOWS = 10
"""Clean steps, in loss_scale_windows, before the first margin level (one halving) is dropped."""
OVERFLOW_BURST_STEPS = 2 * HISTORY
"""An overflow this soon after the previous one, or after a margin change, proves the margin short."""
MARGIN_RECOVERY_STEPS = HISTORY
"""Clean steps before a margin level above the first is halved, at first: short, so that a burst of
spikes does not hold the scale down."""


def next_power_of_two_scale(peak_max_abs, threshold, min_scale, max_scale=MAX_SCALE):
    """The power of two ``s`` with ``peak * s <= threshold * 65504`` closest to it, in [min, max]."""
    if not (peak_max_abs > 0 and math.isfinite(peak_max_abs)):
        return max_scale  # all-zero gradients: nothing to protect, use the most resolution
    exponent = math.floor(math.log2(threshold * FP16_MAX / peak_max_abs))
    return float(min(max(2.0**exponent, min_scale), max_scale))


class AdaptiveLossScaler(DynamicLossScaler):
    """A ``DynamicLossScaler`` whose scale follows the measured gradient max-abs.

    The optimizer calls ``observe(reduced)`` with the reduced ``[non-finite flag, scaled max-abs]``
    tensor right after its overflow check, then ``update_scale(overflow)`` as for any scaler.
    """

    adaptive = True

    def __init__(self, auto_scale_threshold, reduction_headroom=1.0, **dynamic_args):
        """``reduction_headroom``: how many times the observed (averaged) gradient the reduction
        itself may hold in fp16: ZeRO-0 all-reduces fp16 gradients as a sum over the ranks
        and divides afterwards, so the sum must fit, not just the average. 1 where the reduction
        does not sum in fp16."""
        super().__init__(**dynamic_args)
        if not 0.0 < auto_scale_threshold <= 1.0:
            raise ValueError(f"fp16.auto_scale_threshold = {auto_scale_threshold}: must be in (0, 1], the fraction of "
                             f"fp16's range (65504) the scaled gradients may use")
        if not reduction_headroom >= 1.0:
            raise ValueError(f"reduction_headroom {reduction_headroom} must be >= 1")
        self.auto_scale_threshold = float(auto_scale_threshold)
        self.reduction_headroom = float(reduction_headroom)
        self.history = deque(maxlen=HISTORY)
        self.margin = 1.0
        self._clean_steps = 0
        self._recovery_steps = MARGIN_RECOVERY_STEPS
        self._lowered = False  # the last change of the margin lowered it (counted in _clean_steps)
        self._observed = None

    def __setstate__(self, state):
        # A checkpoint may hold the scaler pickled whole rather than as saved_loss_scaler / state_dict
        # writes it, and without the recovery state: that state then starts at its defaults.
        self.__dict__.update({"_recovery_steps": MARGIN_RECOVERY_STEPS, "_lowered": False, **state})

    def observe(self, reduced):
        """Take the reduced ``[non-finite, scaled max-abs]`` tensor; returns the overflow flag."""
        flag, scaled_max_abs = (float(v) for v in reduced.float().tolist())
        overflow = flag > 0 or not math.isfinite(scaled_max_abs)
        self._observed = None if overflow else scaled_max_abs / self.cur_scale
        return overflow

    def update_scale(self, overflow):
        if overflow:
            self._learn_from_overflow()
            if self.cur_scale <= self.min_scale and self.raise_error_at_min_scale:
                raise Exception("Current loss scale already at minimum - cannot decrease scale anymore. Exiting run. "
                                f"(deepspeed-hetero adaptive scaler: recent un-scaled gradient max-abs, oldest first: "
                                f"{[float(f'{v:.4g}') for v in self.history]}; non-finite gradients at the minimum "
                                f"scale usually mean a diverged model or an fp16-unsafe operation, not a scale problem)")
            previous = self.cur_scale
            self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            if _rank() == 0:
                logger.info(f"[deepspeed] OVERFLOW! Skipping step. Adaptive loss scale {previous:g} -> {self.cur_scale:g}")
            self.last_overflow_iter = self.cur_iter
        else:
            if self._observed is not None:
                self.history.append(self._observed)
            self._recover()
            if self.history:
                self.cur_scale = next_power_of_two_scale(max(self.history) * self.margin, self._threshold(),
                                                         self.min_scale)
        self._observed = None
        self.cur_iter += 1

    def _threshold(self):
        return self.auto_scale_threshold / self.reduction_headroom

    def _learn_from_overflow(self):
        peak = max(self.history, default=0.0)
        if peak <= 0.0:  # nothing measured to compare with: keep what the overflow proves
            self.history.append(FP16_MAX / self.cur_scale * (1.0 + 2.0**-20))
            return
        burst = self._clean_steps < OVERFLOW_BURST_STEPS
        if burst and self._lowered:  # re-testing the lower margin failed at once: re-test it half as often
            self._recovery_steps = min(2 * self._recovery_steps, self._first_level_steps())
        if burst or self.margin <= 1.0:
            # The smallest power of two that puts the next scale at or below half the overflowing one:
            # 2 * margin when the scale came from this policy, more when it was clamped at MAX_SCALE.
            # Not 2 * surprise: that counts the margin already in the scale a second time.
            surprise = FP16_MAX / (self.cur_scale * peak)
            self.margin = max(2.0 * self.margin, 2.0**(math.floor(math.log2(self._threshold() * surprise)) + 1))
        self._lowered = False
        self._clean_steps = 0

    def _recover(self):
        """One clean step; after enough of them in a row, halve the margin."""
        self._clean_steps += 1
        if self._lowered and self._clean_steps == OVERFLOW_BURST_STEPS:  # the lower margin held: a burst
            self._recovery_steps = max(self._recovery_steps // 2, MARGIN_RECOVERY_STEPS)
        interval = self._first_level_steps() if self.margin <= 2.0 else self._recovery_steps
        if self.margin > 1.0 and self._clean_steps >= interval:
            self.margin = max(1.0, self.margin / 2.0)
            self._lowered = True
            self._clean_steps = 0

    def _first_level_steps(self):
        return max(MARGIN_RECOVERY_STEPS, MARGIN_DECAY_WINDOWS * self.scale_window)

    def state_dict(self):
        """Every field as plain values (the history as a list): what checkpoints store, so that they
        hold no class of the fork and unpickle in upstream DeepSpeed (see ``saved_loss_scaler``)."""
        return {key: list(value) if isinstance(value, deque) else value
                for key, value in vars(self).items() if key != "_observed"}

    def load_state_dict(self, state):
        """Restore ``state_dict()``; also takes a whole scaler, which a checkpoint may hold pickled
        instead of its state dict."""
        if isinstance(state, AdaptiveLossScaler):
            state = state.state_dict()
        values = dict(state)
        values["history"] = deque(values.get("history", ()), maxlen=HISTORY)
        values["_observed"] = None
        self.__setstate__(values)

    def state_summary(self):
        return {"cur_scale": self.cur_scale, "history": list(self.history), "cur_iter": self.cur_iter,
                "margin": self.margin, "recovery_steps": self._recovery_steps}


def validate_auto_scale_threshold(threshold, loss_scale):
    """``fp16.auto_scale_threshold`` (None: upstream's dynamic scaler) against the fp16 block."""
    if threshold is None:
        return
    if isinstance(threshold, bool) or not math.isfinite(threshold) or not 0.0 < threshold <= 1.0:
        raise ValueError(f"fp16.auto_scale_threshold = {threshold!r}: must be in (0, 1], the fraction of fp16's "
                         f"range the scaled gradients may use (e.g. 0.95)")
    if loss_scale != 0:
        raise ValueError(f"fp16.auto_scale_threshold ({threshold}) selects the adaptive loss scaler, which "
                         f"contradicts the static fp16.loss_scale {loss_scale}; set loss_scale to 0 (dynamic) "
                         f"or remove auto_scale_threshold")


def adaptive_scaler_in_use(loss_scaler):
    return getattr(loss_scaler, "adaptive", False)


def zero_check_overflow(scaler, grads, dp_group, model_parallel_all_reduce, stream=None):
    """ZeRO 1-3's overflow check with the adaptive scaler: ``[overflow, max-abs]`` of this rank's
    gradient partition, reduced with MAX over the data-parallel group (the collective that carried
    upstream's overflow flag) and the model-parallel peers; the scaler observes the result.
    ``stream``: the side stream ZeRO-3 reduces on (the default stream waits for it)."""
    from deepspeed import comm as dist
    accelerator = get_accelerator()
    if stream is None:
        reduced = overflow_and_max_abs(grads)
    else:
        with accelerator.stream(stream):
            reduced = overflow_and_max_abs(grads)
        if not accelerator.resolves_data_dependency():
            accelerator.default_stream().wait_stream(stream)
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=dp_group)
    model_parallel_all_reduce(tensor=reduced, op=dist.ReduceOp.MAX)
    return scaler.observe(reduced)


def zero_partition_gradients(optimizer):
    """This rank's ZeRO-1/2 gradient partition at the step, for ``zero_check_overflow``: with the
    optimizer offloaded, the fp32 partitions' gradients on the host (the offloaded path copies each
    reduced gradient there and keeps none on the device; fp16/bf16 values are exact in fp32, so
    the flag and the max-abs are those the device path would measure), else ``averaged_gradients``."""
    if optimizer.cpu_offload:
        return [partition.grad for partition in optimizer.single_partition_of_fp32_groups]
    return [grad for index in range(len(optimizer.bit16_groups)) for grad in optimizer.averaged_gradients[index]]


def overflow_and_max_abs(grads):
    """This rank's ``[non-finite flag, max |g|]`` over ``grads`` as a float32 tensor on the device,
    ready for one MAX all-reduce. One fused pass when the native op is loaded."""
    from deepspeed.runtime.heterogeneous.measure.native import unscale_maxabs_
    max_abs, nonfinite = unscale_maxabs_([g for g in grads if g is not None and g.numel()], 1.0)
    return torch.tensor([1.0 if nonfinite else 0.0, max_abs], dtype=torch.float32,
                        device=get_accelerator().current_device_name())


ADAPTIVE_LOSS_SCALER = "adaptive_loss_scaler"
"""Checkpoint key of the ZeRO-0 fp16 optimizers' adaptive scaler state (a plain dict), and the
attribute that carries it on the scaler ZeRO 1-3 store (``saved_loss_scaler``)."""


def saved_loss_scaler(scaler):
    """What a ZeRO 1-3 checkpoint stores as its loss scaler (upstream pickles the object whole).

    The scaler itself, unless it is the adaptive one: then an upstream ``DynamicLossScaler`` with the
    same scale, iteration and hysteresis, which carries the adaptive state as plain values under
    ``ADAPTIVE_LOSS_SCALER``. The checkpoint then names no class of the fork: upstream DeepSpeed
    loads it and goes on with dynamic scaling from the adaptive scale, and the fork turns it back
    into the adaptive scaler (``loaded_loss_scaler``)."""
    if not isinstance(scaler, AdaptiveLossScaler):
        return scaler
    state = scaler.state_dict()
    stored = DynamicLossScaler.__new__(DynamicLossScaler)
    upstream_fields = set(vars(DynamicLossScaler(init_scale=1.0, scale_window=1, min_scale=1.0, delayed_shift=1,
                                                 consecutive_hysteresis=False)))
    stored.__dict__.update({key: value for key, value in state.items() if key in upstream_fields})
    stored.__dict__[ADAPTIVE_LOSS_SCALER] = state
    return stored


def loaded_loss_scaler(loaded, current):
    """The scaler a ZeRO 1-3 optimizer continues with after loading ``loaded`` from a checkpoint
    (upstream: ``loaded`` itself); ``current`` is the one its config built.

    With the adaptive scaler configured: a copy of it with the checkpoint's state, from the
    adaptive state ``saved_loss_scaler`` stored, else (an upstream scaler, a run without the
    adaptive scaler) from the dynamic scale, iteration and hysteresis alone. Otherwise
    ``loaded``, as upstream does."""
    if not isinstance(current, AdaptiveLossScaler) or isinstance(loaded, AdaptiveLossScaler):
        return loaded
    if not isinstance(loaded, DynamicLossScaler):  # a static scaler: the config's adaptive one starts afresh
        return current
    restored = copy.copy(current)
    state = vars(loaded).get(ADAPTIVE_LOSS_SCALER)
    if state is not None:
        restored.load_state_dict(state)
    else:
        restored.__dict__.update({key: vars(loaded)[key] for key in ("cur_scale", "cur_iter", "last_overflow_iter",
                                                                     "cur_hysteresis") if key in vars(loaded)})
    return restored


def zero0_adaptive_scaler(loss_scale_config, engine):
    """The adaptive scaler for a ZeRO-0 fp16 optimizer (FP16_Optimizer, FP16_UnfusedOptimizer), or
    None unless the engine's config sets ``fp16.auto_scale_threshold`` with dynamic scaling. Those
    optimizers keep their scale in ``loss_scale_config``; the scaler starts from it."""
    fp16 = getattr(getattr(engine, "_config", None), "float16_config", None)
    threshold = getattr(fp16, "auto_scale_threshold", None)
    if threshold is None or not (loss_scale_config.use_grad_scaling and loss_scale_config.dynamic_loss_scale):
        return None
    return AdaptiveLossScaler(threshold,
                              reduction_headroom=_fp16_sum_headroom(engine),
                              init_scale=loss_scale_config.cur_scale,
                              scale_window=loss_scale_config.scale_window,
                              min_scale=loss_scale_config.min_loss_scale,
                              delayed_shift=1,
                              consecutive_hysteresis=False)


def _fp16_sum_headroom(engine):
    """How many ranks' gradients ZeRO-0's all-reduce adds up in fp16 before dividing (engine
    ``allreduce_bucket``): dp world / gradient_predivide_factor with post-scaling, else 1."""
    if engine.communication_data_type != torch.float16 or not engine.postscale_gradients():
        return 1.0
    return max(1.0, engine.dp_world_size / engine.gradient_predivide_factor())


def zero0_check_overflow(scaler, grads, mpu=None):
    """ZeRO-0's gradients are already averaged over the data-parallel ranks, so the local pass sees
    what every replica sees; model-parallel peers hold different slices and reduce with MAX."""
    reduced = overflow_and_max_abs(grads)
    if mpu is not None:
        from deepspeed import comm as dist
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=mpu.get_model_parallel_group())
    return scaler.observe(reduced)


def zero0_update_scale(scaler, loss_scale_config, skip):
    """ZeRO-0's ``_update_scale`` with the adaptive scaler: the scaler decides, and the optimizer's
    ``loss_scale_config`` (what its backward and checkpoints read) follows."""
    scaler.update_scale(skip)
    loss_scale_config.cur_scale = scaler.cur_scale
    loss_scale_config.cur_iter += 1


def _rank():
    from deepspeed import comm as dist
    return dist.get_rank() if dist.is_initialized() else 0
