# SPDX-License-Identifier: Apache-2.0
"""The plan of one optimizer step: every data-parallel rank's micro-batch size and gas.

The engine broadcasts it as ``Plan.to_dict()`` JSON, the batch configuration and the sampler
read it, and the log prints ``Plan.format_table``. Pure logic.
"""

import math
from dataclasses import asdict, dataclass, fields
from functools import cached_property
from typing import Tuple

import numpy as np


def positive_int(value, what):
    """``value`` as an int; ValueError naming ``what`` unless it is an integer >= 1 (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{what} = {value!r} must be a positive integer")
    return int(value)


@dataclass(frozen=True)
class Plan:
    """Per-data-parallel-rank work of one optimizer step; broadcast between ranks as ``to_dict()``."""

    micro_batch_sizes: Tuple[int, ...]
    gradient_accumulation_steps: Tuple[int, ...]
    """Equal on every rank unless per-rank accumulation was allowed and memory made it pay."""
    train_batch_size: int
    strategy: str
    predicted_rank_times: Tuple[float, ...]
    """gas_i * (a_i + b_i * mbs_i) per rank, in the time models' unit."""
    notes: Tuple[str, ...] = ()
    """Remarks for the log: memory limits a fixed plan exceeds, per-rank accumulation in use."""
    time_unit: str = "s"
    """``"s"`` when the time models were measured; ``""`` when they are priors (equal shares or
    datasheet scores before profiling), whose times only compare ranks and carry no unit."""

    def __post_init__(self):
        for name in ("micro_batch_sizes", "gradient_accumulation_steps", "predicted_rank_times", "notes"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        sizes, steps = self.micro_batch_sizes, self.gradient_accumulation_steps
        if not sizes or len(steps) != len(sizes) or len(self.predicted_rank_times) != len(sizes):
            raise ValueError(f"Plan: micro_batch_sizes ({len(sizes)}), gradient_accumulation_steps ({len(steps)}) and "
                             f"predicted_rank_times ({len(self.predicted_rank_times)}) need one entry per rank")
        for rank, (size, gas) in enumerate(zip(sizes, steps)):
            positive_int(size, f"Plan: micro_batch_sizes[{rank}]")
            positive_int(gas, f"Plan: gradient_accumulation_steps[{rank}]")
        if sum(self.samples_per_rank) != self.train_batch_size:
            raise ValueError(f"Plan: sum(mbs_i * gas_i) = {sum(self.samples_per_rank)} differs from train_batch_size "
                             f"{self.train_batch_size}")

    @property
    def world_size(self):
        return len(self.micro_batch_sizes)

    @property
    def samples_per_rank(self):
        """Samples each rank computes per optimizer step: mbs_i * gas_i."""
        return tuple(m * g for m, g in zip(self.micro_batch_sizes, self.gradient_accumulation_steps))

    @property
    def predicted_step_time(self):
        """The slowest rank's predicted time for one optimizer step."""
        return max(self.predicted_rank_times)

    def format_step_time(self):
        """The predicted step time for the log: seconds, or a relative time marked as such."""
        if self.time_unit:
            return f"{self.predicted_step_time:.4g} {self.time_unit}"
        # Priors (device scores) compare the ranks only; a number here would read as a time.
        return "not measured"

    def with_prior_times(self):
        """This plan, its times marked as relative (the time models were priors, not measured)."""
        return Plan(**{**self.to_dict(), "time_unit": ""})

    @cached_property  # read at every backward, and per gradient tensor under torch-style backward
    def loss_weights(self):
        """w_i = W * mbs_i * gas_i / train_batch_size (W * mbs_i / sum(mbs) when gas is equal).

        Applied to rank i's loss before the engine's 1/gas_i scaling, it turns the reducers' mean
        over ranks into the mean over the global batch.
        """
        return tuple(self.world_size * n / self.train_batch_size for n in self.samples_per_rank)

    @property
    def per_rank_gas(self):
        return len(set(self.gradient_accumulation_steps)) > 1

    def to_dict(self):
        return {key: list(value) if isinstance(value, tuple) else value for key, value in asdict(self).items()}

    @classmethod
    def from_dict(cls, values):
        expected = {f.name for f in fields(cls)}
        missing, unknown = expected - set(values) - {"notes", "time_unit"}, set(values) - expected
        if missing or unknown:
            raise ValueError(f"Plan.from_dict: missing keys {sorted(missing)}, unknown keys {sorted(unknown)}")
        return cls(**values)

    def format_table(self, device_names=None):
        """The plan as a printable table: rank, device, mbs, gas, samples/step, predicted time, share."""
        names = ["-"] * self.world_size if device_names is None else [str(name) for name in device_names]
        if len(names) != self.world_size:
            raise ValueError(f"format_table: {len(names)} device names for {self.world_size} ranks")
        batch = self.train_batch_size
        header = ("rank", "device", "mbs", "gas", "samples/step", f"pred. time{' (s)' if self.time_unit else ''}",
                  "share")
        rows = [(str(rank), names[rank], str(m), str(g), str(m * g), f"{t:.4g}" if self.time_unit else "-",
                 f"{100 * m * g / batch:.1f}%")
                for rank, (m, g, t) in enumerate(zip(self.micro_batch_sizes, self.gradient_accumulation_steps,
                                                     self.predicted_rank_times))]
        widths = [max(len(row[column]) for row in [header] + rows) for column in range(len(header))]
        lines = ["  ".join(cell.ljust(width) if column == 1 else cell.rjust(width)
                           for column, (cell, width) in enumerate(zip(row, widths))) for row in [header] + rows]
        mean_time = math.fsum(self.predicted_rank_times) / self.world_size
        lines.append(f"strategy {self.strategy}, train_batch_size {self.train_batch_size}, predicted step time "
                     f"{self.format_step_time()}, balance (mean/max rank time) "
                     f"{100 * mean_time / self.predicted_step_time:.1f}%" +
                     ("" if self.time_unit else " by the devices' prior scores"))
        return "\n".join(lines + [f"note: {note}" for note in self.notes])
