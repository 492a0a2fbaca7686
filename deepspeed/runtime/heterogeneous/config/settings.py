# SPDX-License-Identifier: Apache-2.0
"""The fork's configuration blocks, parsed once per ``DeepSpeedConfig``.

Blocks (README, "Using it")::

    "heterogeneous_config": {...}                       -> HeterogeneousConfig
    "heterogeneous_memory": {...}                       -> HeterogeneousMemoryConfig
    "zero_optimization": {"heterogeneous_offload": {}}  -> HeterogeneousOffloadConfig

The models live in ``blocks.py`` (re-exported here); this module loads them, words their
errors, reads the environment switches and spots misspelled blocks. Upstream silently ignores
unknown top-level keys, so a typo in the fork's blocks would switch a feature off without a word;
every model forbids unknown keys and every error names the full key path and what is allowed.
"""

import difflib
import os
import typing
from dataclasses import dataclass, field
from typing import List

from pydantic import ValidationError

from deepspeed.runtime.config_utils import DeepSpeedConfigModel

from .blocks import (CommunicationConfig, EmulationConfig, HeterogeneousConfig,
                     HeterogeneousMemoryConfig, HeterogeneousOffloadConfig, SchedulerConfig, SpeedChange, Strategy,
                     parse_bytes)
from .strategies import strategy_names

HETEROGENEOUS_CONFIG = "heterogeneous_config"
HETEROGENEOUS_MEMORY = "heterogeneous_memory"
HETEROGENEOUS_OFFLOAD = "heterogeneous_offload"
ZERO_OPTIMIZATION = "zero_optimization"
LR_SCHEDULER = "scheduler"

ENV_ENABLE = "DS_HETEROGENEOUS_ENV"
ENV_ADAPTIVE_SCHEDULING = "DS_ADAPTIVE_SCHEDULING"
ENV_SWITCHES = (ENV_ENABLE, ENV_ADAPTIVE_SCHEDULING)
"""Every environment variable that shapes the fork's settings: each rank reads its own, so they
must be set alike on every node (``agreement.check_settings_agree``)."""

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


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


def _near_key(key, allowed):
    """The allowed key a misspelled ``key`` most likely means: a close spelling (difflib ratio >=
    0.75: 'profile_step', 'speed'), else the one allowed key that contains it ('interval' in
    'check_interval'); None when nothing is close."""
    close = difflib.get_close_matches(key, list(allowed), n=1, cutoff=0.75)
    if close:
        return close[0]
    containing = [name for name in allowed if len(key) >= 4 and key in name]
    return containing[0] if len(containing) == 1 else None


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
            near = _near_key(str(loc[-1]), allowed)
            hint = f"did you mean '{near}'? " if near else ""
            lines.append(f"{path}: unknown key '{loc[-1]}'; {hint}allowed keys: {', '.join(allowed)}")
        else:
            message = error["msg"].removeprefix("Value error, ")
            shown = "" if error["type"] == "value_error" else f" (got {error.get('input')!r})"
            # A value of the wrong type: say what the key takes, range included.
            allowed = _allowed_values(model, loc) if error["type"].endswith(("_type", "_parsing", "_from_float")) else None
            lines.append(f"{path}: {message}{shown}" + (f"; allowed: {allowed}" if allowed else ""))
    return "invalid DeepSpeed config: " + "; ".join(lines)


_KINDS = {"integer": "an integer", "number": "a number", "boolean": "true or false", "string": "a string"}


def _allowed_values(model, loc):
    """What the key at ``loc`` of ``model`` takes, from its JSON schema: the kind and range of a
    number ("an integer >= 0", "a number in (0, 1]"), or the allowed words; None where not known."""
    schema = model.model_json_schema()
    definitions = schema.get("$defs", {})

    def resolve(node):
        while "$ref" in node:
            node = definitions.get(node["$ref"].rsplit("/", 1)[-1], {})
        return node

    def branches(node):
        node = resolve(node)
        return [resolve(b) for b in node.get("anyOf", [node])]

    nodes = [schema]
    for part in loc:
        found = []
        for node in (b for n in nodes for b in branches(n)):
            child = node.get("items") if isinstance(part, int) else node.get("properties", {}).get(part)
            if child is not None:
                found.append(child)
        nodes = found
    described = [_describe(node) for n in nodes for node in branches(n) if node.get("type") != "null"]
    described = [d for d in described if d]
    return " or ".join(dict.fromkeys(described)) or None


def _describe(node):
    if "enum" in node or "const" in node:
        return " or ".join(repr(v) for v in node.get("enum", [node.get("const")]))
    kind = _KINDS.get(node.get("type"))
    if kind is None:
        return None
    low = (f"> {node['exclusiveMinimum']:g}" if "exclusiveMinimum" in node else
           f">= {node['minimum']:g}" if "minimum" in node else None)
    high = (f"< {node['exclusiveMaximum']:g}" if "exclusiveMaximum" in node else
            f"<= {node['maximum']:g}" if "maximum" in node else None)
    if low and high:
        return (f"{kind} in {'(' if low[0:2] == '> ' else '['}{low.split()[-1]}, {high.split()[-1]}"
                f"{')' if high[0:2] == '< ' else ']'}")
    return " ".join(filter(None, [kind, low, high]))


class HeterogeneousConfigError(ValueError):
    """An invalid fork block or setting: every rank raises it alike, and a script that does not catch
    it ends with the message printed once, by global rank 0 (``config.errors.one_line_config_errors``)."""


def _build(model, block, value):
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise HeterogeneousConfigError(f"invalid DeepSpeed config: {block} must be a JSON object, got "
                                       f"{type(value).__name__}")
    try:
        return model(**value)
    except ValidationError as exc:
        raise HeterogeneousConfigError(_format_error(block, model, exc)) from None


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


def load_heterogeneous_settings(param_dict, world_size=None, environ=None, process_count=None):
    """Parse the fork's blocks of a ds_config dict.

    Args:
        param_dict: the ds_config as a dict. A top-level ``"scheduler": {"type": "compute_aware",
            ...}`` block (an alias of ``heterogeneous_config.scheduler``) is *removed* from it (the
            key is the LR scheduler's); pass a copy if the caller's dict must stay intact.
        world_size: data-parallel world size, to check per-rank lists; None skips that check.
        environ: the environment to read DS_HETEROGENEOUS_ENV / DS_ADAPTIVE_SCHEDULING from
            (default ``os.environ``).
        process_count: with pipeline or model parallelism, the number of processes (global ranks):
            the emulation's lists are per global rank then; None: per data-parallel rank.

    Returns:
        HeterogeneousSettings. Raises ValueError naming the key and the allowed values.
    """
    environ = os.environ if environ is None else environ
    notes = [misspelled_block_note(key, match) for key, match in misspelled_blocks(param_dict)]
    raw = param_dict.get(HETEROGENEOUS_CONFIG)
    raw = dict(raw) if isinstance(raw, dict) else raw

    alias = param_dict.get(LR_SCHEDULER)
    if isinstance(alias, dict) and alias.get("type") in strategy_names():
        param_dict.pop(LR_SCHEDULER)
        if isinstance(raw, dict) and "scheduler" in raw:
            raise HeterogeneousConfigError("invalid DeepSpeed config: both the top-level 'scheduler' (type "
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
        if config.enabled and config.strategy.adapts:
            config.scheduler.dynamic_rebalancing = True
            notes.append(f"{ENV_ADAPTIVE_SCHEDULING}=true: dynamic rebalancing on")
        else:
            notes.append(f"{ENV_ADAPTIVE_SCHEDULING} ignored: it needs heterogeneous_config enabled with a strategy "
                         f"that adapts to measured speeds (got '{config.load_balancing_strategy}')")

    memory = _build(HeterogeneousMemoryConfig, HETEROGENEOUS_MEMORY, param_dict.get(HETEROGENEOUS_MEMORY))
    zero = param_dict.get(ZERO_OPTIMIZATION)
    offload_raw = zero.get(HETEROGENEOUS_OFFLOAD) if isinstance(zero, dict) else None
    offload = _build(HeterogeneousOffloadConfig, f"{ZERO_OPTIMIZATION}.{HETEROGENEOUS_OFFLOAD}", offload_raw)

    if world_size is not None and config.enabled:
        _check_per_rank_lists(config, int(world_size), process_count)
    if isinstance(memory.zero_partitions, list):
        if not config.enabled:
            notes.append(f"{HETEROGENEOUS_MEMORY}.zero_partitions ignored: uneven ZeRO partitions need "
                         f"{HETEROGENEOUS_CONFIG}.enabled")
        elif world_size is not None and len(memory.zero_partitions) != int(world_size):
            raise HeterogeneousConfigError(f"invalid DeepSpeed config: {HETEROGENEOUS_MEMORY}.zero_partitions has "
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


def _check_per_rank_lists(config, world_size, process_count=None):
    """One entry per data-parallel rank; with pipeline or model parallelism (``process_count``
    processes), the emulation's lists have one entry per global rank: each process is a device."""
    micro = config.micro_batch_sizes
    if isinstance(micro, list) and len(micro) != world_size:
        raise HeterogeneousConfigError(f"invalid DeepSpeed config: {HETEROGENEOUS_CONFIG}.micro_batch_sizes has "
                                       f"{len(micro)} entries but the data-parallel world has {world_size} ranks; "
                                       "give one entry per rank")
    lists = {}
    if config.emulation is not None:
        lists.update({"emulation.speeds": config.emulation.speeds, "emulation.memory_gb": config.emulation.memory_gb})
        for index, change in enumerate(config.emulation.speed_schedule or []):
            lists[f"emulation.speed_schedule[{index}].speeds"] = change.speeds
    per_process = process_count is not None and int(process_count) != world_size
    expected = int(process_count) if per_process else world_size
    for key, values in lists.items():
        if isinstance(values, list) and len(values) != expected:
            if per_process:
                raise HeterogeneousConfigError(
                    f"invalid DeepSpeed config: {HETEROGENEOUS_CONFIG}.{key} has {len(values)} entries but the job "
                    f"has {expected} processes; with pipeline or model parallelism ({expected} processes, "
                    f"{world_size} data-parallel replica(s)) the emulation gives one entry per global rank")
            raise HeterogeneousConfigError(f"invalid DeepSpeed config: {HETEROGENEOUS_CONFIG}.{key} has {len(values)} "
                                           f"entries but the data-parallel world has {world_size} ranks; give one "
                                           "entry per rank")
