# SPDX-License-Identifier: Apache-2.0
"""The fork's configuration blocks, parsed once per ``DeepSpeedConfig``.

Blocks (README, "Using it")::

    "heterogeneous_config": {...}                       -> HeterogeneousConfig
    "heterogeneous_memory": {...}                       -> HeterogeneousMemoryConfig
    "zero_optimization": {"heterogeneous_offload": {}}  -> HeterogeneousOffloadConfig

Upstream silently ignores unknown top-level keys, so a typo in the fork's blocks would switch
a feature off without a word; every model here forbids unknown keys and every error names the
full key path and what is allowed.
"""

import difflib
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Annotated, Dict, List, Literal, Optional, Union

from pydantic import (AfterValidator, BeforeValidator, Field, PositiveFloat, PositiveInt, ValidationError,
                      field_validator, model_validator)

from deepspeed.runtime.config_utils import DeepSpeedConfigModel

HETEROGENEOUS_CONFIG = "heterogeneous_config"
HETEROGENEOUS_MEMORY = "heterogeneous_memory"
HETEROGENEOUS_OFFLOAD = "heterogeneous_offload"
ZERO_OPTIMIZATION = "zero_optimization"
LR_SCHEDULER = "scheduler"

ENV_ENABLE = "DS_HETEROGENEOUS_ENV"
ENV_ADAPTIVE_SCHEDULING = "DS_ADAPTIVE_SCHEDULING"
"""Emulation and tests: the host of each data-parallel rank ("0,0,1,1"), read by
``hierarchical.engine_hosts`` when the fork discovered no topology."""
ENV_SWITCHES = (ENV_ENABLE, ENV_ADAPTIVE_SCHEDULING)
"""Every environment variable that shapes the fork's settings: each rank reads its own, so they
must be set alike on every node (``agreement.check_settings_agree``); a rank with other hosts
would create other process groups than its peers and hang them."""

STRATEGIES = ("uniform", "compute_aware", "manual")
Strategy = Literal["uniform", "compute_aware", "manual"]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


class SchedulerConfig(DeepSpeedConfigModel):
    """``heterogeneous_config.scheduler``: how and when the work split is revised."""

    type: Optional[Strategy] = None
    """Seed-style name of the strategy; when given it must agree with load_balancing_strategy."""
    dynamic_rebalancing: bool = False
    """Re-plan during training when measured speeds drift (also on with DS_ADAPTIVE_SCHEDULING=true)."""
    imbalance_threshold: float = Field(0.1, gt=0.0, lt=1.0)
    """Minimum predicted step-time gain (fraction) that justifies a new plan."""
    check_interval: PositiveInt = 20
    """Steps between two imbalance checks."""
    cooldown_checks: int = Field(1, ge=0)
    """Checks skipped after a rebalance: the new plan is measured for a whole interval before it
    can be judged (and its observed gain logged)."""


def _relative_speed(speed):
    if not 0.0 < speed <= 1.0:
        raise ValueError(f"{speed} is not in (0, 1]: each speed is relative to the fastest device (1.0)")
    return speed


RelativeSpeed = Annotated[float, AfterValidator(_relative_speed)]
"""An emulated rank's speed as a fraction of the unthrottled device, in (0, 1]; an error names its index."""


class SpeedChange(DeepSpeedConfigModel):
    """One entry of ``emulation.speed_schedule``: from optimizer step ``step`` on, rank r runs at
    ``speeds[r]``."""

    step: PositiveInt
    speeds: List[RelativeSpeed]


class EmulationConfig(DeepSpeedConfigModel):
    """``heterogeneous_config.emulation``: an emulated mixed cluster, for tests and demos only."""

    speeds: Optional[List[RelativeSpeed]] = None
    """Relative speed of each data-parallel rank, in (0, 1]; 1.0 is the unthrottled device."""
    memory_gb: Optional[List[PositiveFloat]] = None
    """Emulated device memory of each data-parallel rank, in GB of 2**30 bytes (as the device table);
    the planner keeps each rank within it and a rank that exceeds it fails as out of memory."""
    speed_schedule: Optional[List[SpeedChange]] = None
    """Speed changes during training, e.g. [{"step": 30, "speeds": [1.0, 0.4]}]: a device that
    throttles or gets a noisy neighbour, for tests and benchmarks of dynamic rebalancing."""
    mode: Literal["auto", "cgroup", "dilation"] = "auto"
    """cgroup: a CPU-quota cgroup per rank; dilation: the rank sleeps in proportion to its compute;
    auto: cgroup where the machine allows it, else dilation."""

    @model_validator(mode="after")
    def _schedule_steps_increase(self):
        steps = [change.step for change in self.speed_schedule or []]
        if steps != sorted(set(steps)):
            raise ValueError(f"speed_schedule steps {steps} must be increasing, one entry per step")
        return self


def _auto_or_bool(value):
    # A plain bool field would take pydantic's lax spellings ("yes", 1, "on") and an unknown word
    # would come back as two union errors; one message that names the three values is clearer.
    if value is True or value is False or value == "auto":
        return value
    raise ValueError(f"{value!r} is not allowed; use true, false or \"auto\"")


def _compression_dtype(value):
    if value is False or value is None or value in ("bf16", "fp16"):
        return value or False
    raise ValueError(f"{value!r} is not allowed; use false, \"bf16\" or \"fp16\"")


AutoOrBool = Annotated[Union[Literal["auto"], bool], BeforeValidator(_auto_or_bool)]
"""true / false / "auto" (on when the fork is enabled and the ranks span more than one host)."""


class CommunicationConfig(DeepSpeedConfigModel):
    """``heterogeneous_config.communication``: how gradients travel on a cluster of several hosts.

    The exact parts are on by default (``auto``) wherever they can matter: the fork is enabled and
    the data-parallel ranks span more than one host (``topology``); a user turns them off with
    ``false``. Compression is not exact, hence opt-in."""

    hierarchical_reduction: AutoOrBool = "auto"
    """ZeRO-0/1/2 gradient all-reduce in three steps: inside each host, shards between hosts,
    inside each host again (``hierarchical.py``). Equal to the flat all-reduce up to summation
    order. ``true`` where it cannot apply (data-parallel group smaller than the world) is an error."""
    compress_inter_host: Union[Literal["bf16", "fp16"], bool] = False
    """Send the inter-host step of the hierarchical reduction in bf16 or fp16 (in-host steps stay in
    the gradient's dtype). Not exact: the sum between hosts is rounded to 8 (bf16) or 11 (fp16)
    mantissa bits. Needs hierarchical_reduction in force."""
    link_aware_buckets: AutoOrBool = "auto"
    """ZeRO's gradient bucket size from the slowest measured inter-host link (``link_buckets.py``)
    instead of upstream's one default for every link; the same size on every rank, and a size the
    config sets itself is kept. ``auto``: on when the fork is enabled and the ranks span more than
    one host."""

    @field_validator("compress_inter_host", mode="before")
    @classmethod
    def _known_compression(cls, value):
        return _compression_dtype(value)

    @model_validator(mode="after")
    def _compression_needs_hierarchy(self):
        if self.compress_inter_host and self.hierarchical_reduction is False:
            raise ValueError(f"compress_inter_host '{self.compress_inter_host}' compresses the inter-host step of "
                             "the hierarchical reduction, which hierarchical_reduction false turns off: drop one")
        return self


class HeterogeneousConfig(DeepSpeedConfigModel):
    """``heterogeneous_config``: per-device work allocation. Off by default (upstream behaviour)."""

    enabled: bool = False
    load_balancing_strategy: Strategy = "compute_aware"
    mixed_precision_support: Literal["config", "adaptive", "bf16", "fp16", "fp32"] = "config"
    """config: the ds_config's own fp16/bf16 blocks decide; adaptive: bf16 when every rank supports
    it, else fp16; bf16/fp16/fp32: forced, failing when a rank cannot run it."""
    micro_batch_sizes: Optional[Union[List[PositiveInt], Dict[str, PositiveInt]]] = None
    """manual strategy: one micro-batch size per data-parallel rank, or a map device name -> size."""
    profile_steps: int = Field(3, ge=0)
    """Steps timed at start-up to replace the spec-sheet prior with measured speeds."""
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    emulation: Optional[EmulationConfig] = None
    check_fed_batch: bool = True
    """Stop when a rank is fed a micro-batch whose size (dim 0 of the first tensor passed to forward)
    is not its planned one; turn off only for inputs that are not batch-first."""
    communication: CommunicationConfig = Field(default_factory=CommunicationConfig)
    """How gradients travel between hosts (hierarchical reduction, inter-host compression)."""

    @model_validator(mode="after")
    def _consistent(self):
        if self.load_balancing_strategy == "manual" and not self.micro_batch_sizes:
            raise ValueError("load_balancing_strategy 'manual' needs micro_batch_sizes (a list with one size per "
                             "data-parallel rank, or a map from device name to size)")
        if self.micro_batch_sizes and self.load_balancing_strategy != "manual":
            raise ValueError(f"micro_batch_sizes is only used by load_balancing_strategy 'manual' (got "
                             f"'{self.load_balancing_strategy}'): set the strategy to 'manual' or remove the sizes")
        if self.scheduler.type is not None and self.scheduler.type != self.load_balancing_strategy:
            if "load_balancing_strategy" in self.model_fields_set:
                raise ValueError(f"scheduler.type '{self.scheduler.type}' contradicts load_balancing_strategy "
                                 f"'{self.load_balancing_strategy}': keep one of them")
            self.load_balancing_strategy = self.scheduler.type
        if self.scheduler.dynamic_rebalancing and self.load_balancing_strategy != "compute_aware":
            raise ValueError(f"scheduler.dynamic_rebalancing needs load_balancing_strategy 'compute_aware' (got "
                             f"'{self.load_balancing_strategy}')")
        return self


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(value):
    """'64GB' -> 64e9, '512MiB' -> 512 * 2**20, an int -> itself. ValueError names what is allowed."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a size")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"{value} is negative")
        return int(value)
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
    if not match or match.group(2).upper() not in _SIZE_UNITS:
        raise ValueError(f"{value!r} is not a size; write a number of bytes or e.g. '64GB', '512MiB' "
                         f"(units: {', '.join(u for u in _SIZE_UNITS if u)})")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])


class HeterogeneousMemoryConfig(DeepSpeedConfigModel):
    """``heterogeneous_memory``: per-rank memory budgets and host buffers."""

    enabled: bool = False
    adaptive_chunking: bool = True
    """Per-rank prefetch and live-parameter budgets from free memory (bucket sizes stay uniform)."""
    hbm_utilization_threshold: float = Field(0.85, gt=0.0, le=1.0)
    """Fraction of each device's memory the planner may fill."""
    cpu_memory_limit: Optional[Union[int, str]] = None
    """Hard limit of pinned host buffers, e.g. '64GB'; None: no limit."""
    zero_partitions: Union[Literal["auto", "even"], List[PositiveFloat]] = "auto"
    """ZeRO-1/2 optimizer-state shares: "auto" (from each rank's memory and speed when ``enabled``),
    "even" (upstream's 1/N), or one share per data-parallel rank summing to 1."""

    @field_validator("zero_partitions")
    @classmethod
    def _shares_sum_to_one(cls, value):
        if isinstance(value, list) and abs(sum(value) - 1.0) > 1e-6:
            raise ValueError(f"{value} sums to {sum(value):.6g}; give one share per data-parallel rank, "
                             "summing to 1, or \"auto\" / \"even\"")
        return value

    @field_validator("cpu_memory_limit")
    @classmethod
    def _size_parses(cls, value):
        if value is not None:
            parse_bytes(value)
        return value

    @property
    def cpu_memory_limit_bytes(self):
        return None if self.cpu_memory_limit is None else parse_bytes(self.cpu_memory_limit)


class HeterogeneousOffloadConfig(DeepSpeedConfigModel):
    """``zero_optimization.heterogeneous_offload``: each rank decides alone what it offloads."""

    cpu_offload: bool = False
    nvme_offload: bool = False
    nvme_path: Optional[str] = None

    @model_validator(mode="after")
    def _nvme_needs_path(self):
        if self.nvme_offload and not self.nvme_path:
            raise ValueError("nvme_offload needs nvme_path (a directory on the NVMe device)")
        return self


@dataclass
class HeterogeneousSettings:
    """Everything the fork reads from one ds_config, parsed once."""

    config: HeterogeneousConfig
    memory: HeterogeneousMemoryConfig
    offload: HeterogeneousOffloadConfig
    notes: List[str] = field(default_factory=list)
    """Decisions taken on the user's behalf (environment variables, aliases), for logs and reports."""

    @property
    def enabled(self):
        return self.config.enabled


def settings_summary(settings, environ=None):
    """What every rank must agree on, as plain data: ``{"settings": {key path: value}, "env":
    {variable: raw value or None}}``, the parsed blocks flattened to the key paths a user writes
    (``heterogeneous_config.scheduler.dynamic_rebalancing``) and the raw environment switches
    (``ENV_SWITCHES``) that shaped them."""
    environ = os.environ if environ is None else environ
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for key in sorted(value):
                walk(f"{prefix}.{key}", value[key])
        else:
            flat[prefix] = value

    for block, model in ((HETEROGENEOUS_CONFIG, settings.config), (HETEROGENEOUS_MEMORY, settings.memory),
                         (f"{ZERO_OPTIMIZATION}.{HETEROGENEOUS_OFFLOAD}", settings.offload)):
        walk(block, model.model_dump(mode="json"))
    return {"settings": flat, "env": {name: environ.get(name) for name in ENV_SWITCHES}}


def _allowed_keys(model, loc):
    """The field names of the (nested) model that the error location points into."""
    for part in loc[:-1]:
        if isinstance(part, int) or model is None:
            continue
        info = model.model_fields.get(part)
        model = None
        if info is not None:
            for candidate in (info.annotation, *typing.get_args(info.annotation)):
                if isinstance(candidate, type) and issubclass(candidate, DeepSpeedConfigModel):
                    model = candidate
    return sorted(model.model_fields) if model is not None else []


def _format_error(block, model, exc):
    lines = []
    errors = exc.errors()
    # A union field (a list or a map) reports one error per branch; the wrong-container ones are noise.
    specific = [e for e in errors if e["type"] not in ("list_type", "dict_type")]
    for error in specific or errors:
        # Drop pydantic's union branch tags such as 'list[constrained-int]' from the key path.
        loc = tuple(part for part in error["loc"] if isinstance(part, int) or "[" not in part)
        path = ".".join([block] + [f"[{p}]" if isinstance(p, int) else str(p) for p in loc]).replace(".[", "[")
        if error["type"] == "extra_forbidden":
            allowed = _allowed_keys(model, loc)
            lines.append(f"{path}: unknown key '{loc[-1]}'; allowed keys: {', '.join(allowed)}")
        else:
            message = error["msg"].removeprefix("Value error, ")
            shown = "" if error["type"] == "value_error" else f" (got {error.get('input')!r})"
            lines.append(f"{path}: {message}{shown}")
    return "invalid DeepSpeed config: " + "; ".join(lines)


def _build(model, block, value):
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise ValueError(f"invalid DeepSpeed config: {block} must be a JSON object, got {type(value).__name__}")
    try:
        return model(**value)
    except ValidationError as exc:
        raise ValueError(_format_error(block, model, exc)) from None


def env_flag(name, environ):
    """A boolean environment variable; an unknown spelling is an error, never silently false."""
    raw = environ.get(name)
    if raw is None:
        return None
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"environment variable {name}={raw!r}: use one of 1/true/yes/on or 0/false/no/off")


def load_heterogeneous_settings(param_dict, world_size=None, environ=None):
    """Parse the fork's blocks of a ds_config dict.

    Args:
        param_dict: the ds_config as a dict. The seed-style top-level ``"scheduler": {"type":
            "compute_aware", ...}`` is *removed* from it (it is the LR scheduler's key); pass a
            copy if the caller's dict must stay intact.
        world_size: data-parallel world size, to check per-rank lists; None skips that check.
        environ: the environment to read DS_HETEROGENEOUS_ENV / DS_ADAPTIVE_SCHEDULING from
            (default ``os.environ``).

    Returns:
        HeterogeneousSettings. Raises ValueError naming the key and the allowed values.
    """
    environ = os.environ if environ is None else environ
    notes = [misspelled_block_note(key, match) for key, match in misspelled_blocks(param_dict)]
    raw = param_dict.get(HETEROGENEOUS_CONFIG)
    raw = dict(raw) if isinstance(raw, dict) else raw

    alias = param_dict.get(LR_SCHEDULER)
    if isinstance(alias, dict) and alias.get("type") in STRATEGIES:
        param_dict.pop(LR_SCHEDULER)
        if isinstance(raw, dict) and "scheduler" in raw:
            raise ValueError("invalid DeepSpeed config: both the top-level 'scheduler' (type "
                             f"'{alias['type']}') and heterogeneous_config.scheduler are given; keep only "
                             "heterogeneous_config.scheduler (the top-level key is the learning-rate scheduler's)")
        raw = dict(raw or {})
        raw["scheduler"] = {k: v for k, v in alias.items() if k != "params"}
        raw["scheduler"].update(alias.get("params") or {})
        notes.append(f"top-level 'scheduler' of type '{alias['type']}' read as heterogeneous_config.scheduler; "
                     "move it there (the top-level key is the learning-rate scheduler's)")

    if raw is None and env_flag(ENV_ENABLE, environ):
        raw = {"enabled": True}
        notes.append(f"{ENV_ENABLE} is set and the config has no {HETEROGENEOUS_CONFIG}: enabled with defaults")
    elif env_flag(ENV_ENABLE, environ) is not None and raw is not None:
        notes.append(f"{ENV_ENABLE} ignored: the config's own {HETEROGENEOUS_CONFIG} block wins")

    config = _build(HeterogeneousConfig, HETEROGENEOUS_CONFIG, raw)
    if env_flag(ENV_ADAPTIVE_SCHEDULING, environ):
        if config.enabled and config.load_balancing_strategy == "compute_aware":
            config.scheduler.dynamic_rebalancing = True
            notes.append(f"{ENV_ADAPTIVE_SCHEDULING}=true: dynamic rebalancing on")
        else:
            notes.append(f"{ENV_ADAPTIVE_SCHEDULING} ignored: it needs heterogeneous_config enabled with the "
                         "compute_aware strategy")

    memory = _build(HeterogeneousMemoryConfig, HETEROGENEOUS_MEMORY, param_dict.get(HETEROGENEOUS_MEMORY))
    zero = param_dict.get(ZERO_OPTIMIZATION)
    offload_raw = zero.get(HETEROGENEOUS_OFFLOAD) if isinstance(zero, dict) else None
    offload = _build(HeterogeneousOffloadConfig, f"{ZERO_OPTIMIZATION}.{HETEROGENEOUS_OFFLOAD}", offload_raw)

    if world_size is not None and config.enabled:
        _check_per_rank_lists(config, int(world_size))
    if isinstance(memory.zero_partitions, list):
        if not config.enabled:
            notes.append(f"{HETEROGENEOUS_MEMORY}.zero_partitions ignored: uneven ZeRO partitions need "
                         f"{HETEROGENEOUS_CONFIG}.enabled")
        elif world_size is not None and len(memory.zero_partitions) != int(world_size):
            raise ValueError(f"invalid DeepSpeed config: {HETEROGENEOUS_MEMORY}.zero_partitions has "
                             f"{len(memory.zero_partitions)} shares {memory.zero_partitions} but there are "
                             f"{int(world_size)} data-parallel ranks; give one share per rank, or \"auto\" / \"even\"")
    return HeterogeneousSettings(config=config, memory=memory, offload=offload, notes=notes)


# The fork's own keys, and where each belongs; a near-miss of one at the top level is reported.
_FORK_KEY_PATHS = {HETEROGENEOUS_CONFIG: HETEROGENEOUS_CONFIG, HETEROGENEOUS_MEMORY: HETEROGENEOUS_MEMORY,
                   HETEROGENEOUS_OFFLOAD: f"{ZERO_OPTIMIZATION}.{HETEROGENEOUS_OFFLOAD}"}
# Similarity (difflib ratio, 0..1) above which an unknown key is taken for a misspelled fork key:
# 'heterogenous_config', 'heterogeneous-config' and 'heterogeneous_memmory' score 0.95 or more, a
# bare 'heterogeneous' 0.79.
_NEAR_MISS_CUTOFF = 0.85


def _upstream_top_level_keys():
    """The key names upstream's config reads (a superset of its top-level keys). A key upstream
    knows is never reported, however close to a fork key it is."""
    from deepspeed.runtime import constants
    return {value for name, value in vars(constants).items() if name.isupper() and isinstance(value, str)}


def misspelled_blocks(param_dict):
    """(key, fork key it is close to) for each top-level key of ``param_dict`` that neither the
    fork nor upstream knows but that is close to one of the fork's block names. Upstream ignores
    unknown top-level keys, so such a block would silently leave the fork off."""
    unknown = [key for key in param_dict if isinstance(key, str) and key not in (HETEROGENEOUS_CONFIG,
                                                                                 HETEROGENEOUS_MEMORY)]
    if not unknown:
        return []
    known = _upstream_top_level_keys()
    found = []
    for key in unknown:
        if key in known:
            continue
        spelled = key.lower().replace("-", "_").replace(" ", "_")
        match = difflib.get_close_matches(spelled, list(_FORK_KEY_PATHS), n=1, cutoff=_NEAR_MISS_CUTOFF)
        if match:
            found.append((key, match[0]))
    return found


def misspelled_block_note(key, fork_key):
    path = _FORK_KEY_PATHS[fork_key]
    if key == fork_key:  # heterogeneous_offload at the top level: right name, wrong place
        return f"top-level '{key}' is ignored: it belongs in {ZERO_OPTIMIZATION} ('{path}')"
    return (f"unknown top-level key '{key}' is ignored; did you mean '{path}'? (until it is renamed, none of its "
            "settings apply)")


def _check_per_rank_lists(config, world_size):
    lists = {"micro_batch_sizes": config.micro_batch_sizes}
    if config.emulation is not None:
        lists.update({"emulation.speeds": config.emulation.speeds, "emulation.memory_gb": config.emulation.memory_gb})
        for index, change in enumerate(config.emulation.speed_schedule or []):
            lists[f"emulation.speed_schedule[{index}].speeds"] = change.speeds
    for key, values in lists.items():
        if isinstance(values, list) and len(values) != world_size:
            raise ValueError(f"invalid DeepSpeed config: {HETEROGENEOUS_CONFIG}.{key} has {len(values)} entries but "
                             f"the data-parallel world has {world_size} ranks; give one entry per rank")
