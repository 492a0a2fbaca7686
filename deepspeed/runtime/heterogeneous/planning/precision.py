# SPDX-License-Identifier: Apache-2.0
"""Training precision for a mixed cluster (``heterogeneous_config.mixed_precision_support``).

Mixed clusters mix precision capabilities: a V100 or a T4 has no bf16, an A100 or H100 has. The
modes:

- ``config`` (default): the ds_config's own ``fp16``/``bf16`` blocks decide, as upstream.
- ``adaptive``: bf16 when every data-parallel rank supports it; otherwise fp16 with the adaptive
  loss scaler (``fp16.auto_scale_threshold``, 0.95 unless the config sets it) when every rank
  supports fp16; otherwise fp32.
- ``bf16``, ``fp16``, ``fp32``: forced; a rank that cannot run the forced type stops
  ``deepspeed.initialize`` with its name.

The choice wins over the config's own blocks, and when they disagree the log says which block
was overridden and why. Pure logic: the caller gathers the devices and applies the choice.
"""

from dataclasses import dataclass
from typing import Optional

DEFAULT_AUTO_SCALE_THRESHOLD = 0.95


@dataclass(frozen=True)
class PrecisionChoice:
    dtype: str
    """'bf16', 'fp16' or 'fp32'."""
    reason: str
    overridden: Optional[str] = None
    """What the choice overrides in the config's own fp16/bf16 blocks, for the log; None if nothing."""


def _ranks_without(devices, kind):
    return [f"rank {d.rank} ({d.name})" if hasattr(d, "rank") else str(d) for d in devices if not getattr(d, kind)]


def _configured(fp16_enabled, bf16_enabled):
    return "fp16" if fp16_enabled else "bf16" if bf16_enabled else "fp32"


def choose_precision(mode, devices, fp16_enabled=False, bf16_enabled=False):
    """The precision every rank trains in, or None for mode 'config' (the config decides).

    Args:
        mode: heterogeneous_config.mixed_precision_support.
        devices: one DeviceDescription (``bf16``, ``fp16``, ``rank``, ``name``) per data-parallel rank.
        fp16_enabled, bf16_enabled: the config's own blocks.
    """
    if mode == "config":
        return None
    if mode not in ("adaptive", "bf16", "fp16", "fp32"):
        raise ValueError(f"mixed_precision_support {mode!r}: use config, adaptive, bf16, fp16 or fp32")
    no_bf16, no_fp16 = _ranks_without(devices, "bf16"), _ranks_without(devices, "fp16")
    if mode == "adaptive":
        if not no_bf16:
            dtype, reason = "bf16", "every rank supports bf16"
        elif not no_fp16:
            dtype, reason = "fp16", (f"{', '.join(no_bf16)} cannot run bf16; every rank supports fp16, trained "
                                     f"with the adaptive loss scaler")
        else:
            dtype, reason = "fp32", (f"no half type every rank supports (no bf16: {', '.join(no_bf16)}; no fp16: "
                                     f"{', '.join(no_fp16)})")
    else:
        missing = {"bf16": no_bf16, "fp16": no_fp16, "fp32": []}[mode]
        if missing:
            raise ValueError(f"heterogeneous_config.mixed_precision_support '{mode}' is forced but {', '.join(missing)} "
                             f"cannot run {mode}; use 'adaptive' to pick what every rank supports, or another type")
        dtype, reason = mode, f"forced by mixed_precision_support '{mode}'"
    configured = _configured(fp16_enabled, bf16_enabled)
    overridden = None
    if configured != dtype:
        blocks = [name for name, on in (("fp16", fp16_enabled), ("bf16", bf16_enabled)) if on]
        overridden = (f"the config's {' and '.join(blocks)} block ({configured}) is overridden" if blocks else
                      f"the config enables no half type (fp32) but {dtype} is used")
        overridden += f": heterogeneous_config.mixed_precision_support '{mode}' wins ({reason})"
    return PrecisionChoice(dtype, reason, overridden)


def _block(param_dict, *keys):
    for key in keys:
        if isinstance(param_dict.get(key), dict):
            return key, param_dict[key]
    return keys[0], {}


def choose_precision_for_config(mode, devices, param_dict):
    """Choose the precision for ``mode`` and write it into ``param_dict``'s fp16/bf16 blocks (new
    dicts: the caller's nested blocks are not modified), before upstream parses them.

    fp16 gets the adaptive loss scaler (``auto_scale_threshold``) unless the config sets a static
    scale or the threshold itself. Returns the PrecisionChoice, or None for mode 'config'."""
    fp16_key, fp16 = _block(param_dict, "fp16")
    bf16_key, bf16 = _block(param_dict, "bf16", "bfloat16")
    choice = choose_precision(mode, devices or [], fp16.get("enabled") is True, bf16.get("enabled") is True)
    if choice is None:
        return None
    fp16 = {**fp16, "enabled": choice.dtype == "fp16"}
    if choice.dtype == "fp16" and fp16.get("loss_scale", 0) == 0 and fp16.get("auto_scale_threshold") is None:
        fp16["auto_scale_threshold"] = DEFAULT_AUTO_SCALE_THRESHOLD
    param_dict[fp16_key] = fp16
    param_dict[bf16_key] = {**bf16, "enabled": choice.dtype == "bf16"}
    return choice
