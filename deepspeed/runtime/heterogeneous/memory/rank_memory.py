# SPDX-License-Identifier: Apache-2.0
"""One rank's memory as the runtime controller follows it through training: its predicted bytes
besides activations (``spec.ModelStateSpec``: what an emulated capacity is checked against, with
the measured activations, and what the profiling steps' memory limits start from),
its measured peak, and the memory pool's report rows, kept current from this rank's own peak at
every step and from every rank's at each agreement that gathers them (profiling, checks). No
collective here: the controller's gathers carry the numbers.
"""

from .meter import EMULATED
from .model_state import engine_sub_groups
from .spec import ModelStateSpec


class RankMemory:
    """``state``: the fork's ``HeterogeneousState`` (its memory pool, meter and plan);
    ``meter_factory(state)``: this rank's memory meter, made at the first reading when the start-up
    did not make one."""

    def __init__(self, state, rank, engine, meter_factory):
        self._state, self.rank, self._engine, self._meter_factory = state, rank, engine, meter_factory
        self._state_bytes = None

    def model_state_bytes(self):
        """This rank's predicted bytes besides activations, computed once: the memory pool's
        predicted peak without activations (what was in use at the start included) where it
        placed this engine, else the same model's (``ModelStateSpec.of_engine``) without the
        start's baseline; activations are counted apart."""
        if self._state_bytes is None:
            pool = self._state.memory_pool
            peak = pool.predicted_peak(self.rank) if pool is not None else None
            if peak is not None:
                self._state_bytes = peak.peak_bytes
            else:
                spec = ModelStateSpec.of_engine(self._engine, emulated_device=self.meter.source == EMULATED)
                shares = self._state.partition_shares
                self._state_bytes = spec.rank_bytes(self._engine._config, self._state.partition_share,
                                                    max(shares) if shares else None, engine_sub_groups(self._engine))
        return self._state_bytes

    @property
    def meter(self):
        if self._state.memory_meter is None:
            self._state.memory_meter = self._meter_factory(self._state)
        return self._state.memory_meter

    def measured_peak_bytes(self):
        """This rank's measured memory peak, None where it cannot be read."""
        return self.meter.peak_bytes()

    def report_own_peak(self):
        """This rank's row of the pool's report, kept current without a collective (its activations,
        measured at its first micro-step, are in its predicted peak from then on); the other ranks'
        rows follow at the agreements (``record_gathered``)."""
        pool = self._state.memory_pool
        if pool is not None:
            pool.record_measured_peaks([self.measured_peak_bytes() if r == self.rank else None
                                        for r in range(pool.world_size)])

    @staticmethod
    def of_gathered(entries):
        """Every rank's measured peak and its last measured activations (None: not measured), from
        a gathered round of the controller's measurements."""
        peaks = [entry.get("peak_bytes") for entry in entries]
        activations = []
        for entry in entries:
            measured = [sample[2] for sample in entry.get("samples", ()) if len(sample) > 2 and sample[2] is not None]
            activations.append(measured[-1] if measured else None)
        return peaks, activations

    def record_gathered(self, peaks, activations):
        """Every rank's measured peaks and the other ranks' activations, into the pool's report."""
        pool = self._state.memory_pool
        if pool is None:
            return
        pool.record_measured_peaks(peaks)
        for rank, measured in enumerate(activations):
            if measured is not None and rank != self.rank:
                pool.record_activations(rank, measured)
