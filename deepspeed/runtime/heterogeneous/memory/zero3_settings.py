# SPDX-License-Identifier: Apache-2.0
"""Heterogeneity-aware ZeRO-3 settings: fewer collectives per step. Pure, except
``configure_zero3_settings``, which only prints.

On a mixed cluster every collective is a point where the faster ranks wait for the slowest, and
its fixed cost (the call, the copies into and out of the flat buffer, the interconnect's work per
message) is paid at the pace of the slowest rank's host: a throttled host processes every message
of a CPU-bound interconnect at its own speed. The planner can shorten a slow rank's compute by
giving it fewer samples, never its share of a collective. So on a mixed cluster a ZeRO-3 step
costs more per collective than per byte, and the settings that cut the number of collectives are
worth more there than on the homogeneous clusters upstream's defaults were tuned on.

Upstream pays most of ZeRO-3's collectives in one place: parameters below
``stage3_param_persistence_threshold`` (1e5 elements) are not partitioned, and after every
optimizer step ZeRO-3 refreshes each of them from its owner with *its own* all-gather
(``_post_step`` -> ``_allgather_params_coalesced``, one ``all_gather_into_tensor`` per parameter).
A transformer has several such parameters per layer (norm weights and biases, projection biases;
all 52 parameters of the benchmark GPT, d_model 128), so every step ends with dozens of
latency-bound collectives. Measured on that GPT (2 ranks, 2 cores, gloo, rank 1 at 0.55 by a CPU
quota): 52 all-gathers took 83 ms of a 375 ms step on the slow rank's pace (46 ms at full speed).

With threshold 0 every parameter is partitioned, and ZeRO-3's prefetcher gathers the parameters
of the coming modules together, one flat all-gather per ``stage3_prefetch_bucket_size`` bucket
(once it has traced a step): the same GPT needs one all-gather per step (4 ms). What it costs:
parameters are gathered again at the next forward instead of kept, a few bytes more per step
(small parameters are small by definition), and nothing in memory (persistent parameters were a
full copy on every rank). The prefetch bucket and the live-parameter budget stay upstream's (or
adaptive chunking's, from the smallest rank's memory): they already hold a bucket of the model.

The value is a constant of the config, so it is the same on every rank without a collective
(anything that shapes a collective must be, docs/architecture.md, "Invariants"). A value the user sets,
under either name, is kept, and so is upstream's where the user set a budget for persistent
parameters (``stage3_model_persistence_threshold``) or offloads parameters (``offload_param``).
"""

from typing import Dict, NamedTuple, Optional

PERSISTENCE_KEY = "stage3_param_persistence_threshold"
PERSISTENCE_ALIAS = "param_persistence_threshold"  # the field name, which upstream's model also accepts

FORK_PERSISTENCE_THRESHOLD = 0
"""Every parameter partitioned: small ones travel in the prefetcher's coalesced gathers."""

UPSTREAM_DEFAULTS = {PERSISTENCE_KEY: 100_000}
"""Upstream 0.19.8's values of the keys this module sets (``DeepSpeedZeroConfig``); the benchmark
writes them into a config to measure the fork without its choice."""

MODEL_PERSISTENCE_KEYS = ("stage3_model_persistence_threshold", "model_persistence_threshold")
"""A budget for persistent parameters: a user who sets it wants persistence, so the threshold stays."""


def offloads_parameters(zero_config):
    """Whether ZeRO-3 keeps parameters off the device (``offload_param`` to cpu or nvme, or the
    legacy ``cpu_offload_param``). There persistence also saves a host-to-device copy per small
    parameter and micro-step, which the collective count does not weigh: upstream's value stays."""
    offload = zero_config.get("offload_param")
    if isinstance(offload, dict) and str(offload.get("device") or "none").lower() != "none":
        return True
    return bool(zero_config.get("cpu_offload_param"))


class Zero3Setting(NamedTuple):
    """One value the fork chose: the ``zero_optimization`` key, the value, upstream's, and why."""

    key: str
    value: int
    upstream: int
    reason: str


def _zero_stage(zero_config):
    stage = zero_config.get("stage", 0)
    try:
        return int(stage)
    except (TypeError, ValueError):
        return None  # upstream's model reports a stage it cannot read


def zero3_settings(zero_config) -> Dict[str, Zero3Setting]:
    """The settings the fork chooses for ``zero_config`` (the user's ``zero_optimization`` dict):
    {key: Zero3Setting} for each key the user did not set; {} unless the stage is 3.

    ``zero_config`` None or not a dict (no block, or the legacy boolean form) is not ZeRO-3."""
    if not isinstance(zero_config, dict) or _zero_stage(zero_config) != 3:
        return {}
    chosen = {}
    persistence_set = any(key in zero_config for key in (PERSISTENCE_KEY, PERSISTENCE_ALIAS) + MODEL_PERSISTENCE_KEYS)
    if not persistence_set and not offloads_parameters(zero_config):
        chosen[PERSISTENCE_KEY] = Zero3Setting(
            PERSISTENCE_KEY, FORK_PERSISTENCE_THRESHOLD, UPSTREAM_DEFAULTS[PERSISTENCE_KEY],
            "every parameter partitioned and gathered in the prefetcher's coalesced buckets, instead of one "
            "all-gather per small parameter after every step")
    return chosen


def apply_zero3_settings(param_dict, user_zero=None) -> Dict[str, Zero3Setting]:
    """Write the chosen settings into ``param_dict``'s ``zero_optimization`` block (a copy: the
    user's dict is not modified) before upstream parses it; returns them.

    ``user_zero``: the keys the user wrote (``link_buckets.keys_set_by_user``, taken before the
    fork wrote sizes into the block); None or absent: the block's current keys. Values the fork
    wrote earlier (adaptive chunking, link-aware buckets) are never touched here: no key overlaps."""
    zero = param_dict.get("zero_optimization")
    if not isinstance(zero, dict):
        return {}
    chosen = zero3_settings({key: value for key, value in zero.items() if user_zero is None or key in user_zero})
    if chosen:
        param_dict["zero_optimization"] = {**zero, **{key: s.value for key, s in chosen.items()}}
    return chosen


def describe_zero3_settings(chosen) -> Optional[str]:
    """The block printed once on rank 0 (like the plan), or None when nothing was chosen."""
    if not chosen:
        return None
    lines = ["[deepspeed-hetero] ZeRO-3 settings chosen for a heterogeneous cluster "
             "(set a key in zero_optimization to override):"]
    for setting in chosen.values():
        lines.append(f"  {setting.key} {setting.value} (upstream {setting.upstream}): {setting.reason}")
    return "\n".join(lines)


_printed = set()  # the blocks this process printed: deepspeed.initialize parses a config more than once


def configure_zero3_settings(state, param_dict, user_zero=None):
    """The coordinator's step (``coordinator._settle_config``): apply the choice to ``param_dict``
    when the fork is on, print it once on global rank 0; returns {key: value} written ({} when
    none)."""
    if not state.enabled:
        return {}
    chosen = apply_zero3_settings(param_dict, user_zero)
    text = describe_zero3_settings(chosen)
    if text is not None and text not in _printed:
        from deepspeed import comm as dist
        if not dist.is_initialized() or dist.get_rank() == 0:
            _printed.add(text)
            print(text, flush=True)
    return {key: setting.value for key, setting in chosen.items()}
