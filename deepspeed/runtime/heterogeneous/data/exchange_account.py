# SPDX-License-Identifier: Apache-2.0
"""What re-splitting a stock loader's batches costs this rank, and whether a re-plan is worth it.

Each micro-step that moved samples (``resplit.py``) adds the bytes this rank received (inputs,
and outputs returned to it) and the seconds its exchange took, forward and backward. The
controller pools the least seconds and the mean bytes of the moving micro-steps at every
agreement (``since_last_pooling``); data-parallel rank 0 keeps the latest pooled estimate and asks
``planning/exchange.py`` whether a candidate plan gains more than its exchange costs, against the
sizes the loader fed (``worth_resplitting``). The estimate and the fed sizes are in checkpoints,
so a resumed run weighs a re-split as the uninterrupted one would.
"""

from ..planning.exchange import exchange_verdict, least_exchange_seconds
from .resplit import ExchangeClock


class ExchangeAccount:
    """One rank's account of its re-split exchanges (the runtime controller keeps one)."""

    def __init__(self):
        self.clock = ExchangeClock()
        self.input_bytes = 0
        """Input bytes other ranks sent this rank by re-splitting, in all."""
        self.output_bytes = 0
        """Output bytes returned to this rank from the ranks that computed them, in all."""
        self.fed_sizes = None
        """What the loader fed the ranks at the last re-split forward (the same on every rank)."""
        self.estimate = (None, None)
        """Rank 0: the latest pooled (seconds, bytes received) of one moving micro-step."""
        self.note = None
        """Rank 0: why the last planning kept the loader's split (None: it did not)."""
        self._began = 0.0
        self._received = 0
        self._pooled = 0  # the moving micro-steps (clock.per_micro_step) at the last pooling
        self._logged = (0, 0, 0)  # the two byte counters and the step at the last plan change

    # -- per micro-step (every rank) ---------------------------------------------------------

    def begin_micro_step(self):
        self._began = self.clock.seconds
        self._received = 0

    def resplit(self, received_bytes=None):
        """A forward was re-split; ``received_bytes``: the inputs other ranks sent this rank (None
        when nothing moved)."""
        self.fed_sizes = self.clock.fed
        if received_bytes is not None:
            self.input_bytes += received_bytes
            self._received = received_bytes

    def returned(self, received_bytes):
        """Outputs other ranks computed came back to this rank."""
        self.output_bytes += received_bytes
        self._received += received_bytes

    def end_micro_step(self, moved):
        """``moved``: this micro-step re-split its samples (its exchange, backward included, counts)."""
        if moved:
            self.clock.per_micro_step.append((self.clock.seconds - self._began, self._received))

    # -- at agreements -----------------------------------------------------------------------

    def since_last_pooling(self, reset):
        """This rank's ``exchange_s`` and ``exchange_bytes`` for the controller's gather: the least
        seconds, and the mean bytes received, of the micro-steps that moved since the last pooling
        (``reset``: start the next interval here). The least: an exchange on a busy host now and
        then takes a hundred times its usual 2 ms, and a plan must not be refused because the
        cheapest exchange seen costs more than it saves; the switch check judges the rest on the
        step's wall time. None where nothing moved."""
        moved = self.clock.per_micro_step[self._pooled:]
        if reset:
            self._pooled = len(self.clock.per_micro_step)
        if not moved:
            return {"exchange_s": None, "exchange_bytes": None}
        return {"exchange_s": min(seconds for seconds, _ in moved),
                "exchange_bytes": sum(received for _, received in moved) / len(moved)}

    def update_estimate(self, entries):
        """Rank 0: keep the latest pooled exchange cost (an interval that moved nothing keeps the last)."""
        seconds, received = least_exchange_seconds(entries)
        if seconds is not None:
            self.estimate = (seconds, received)

    def worth_resplitting(self, plan, models):
        """Rank 0: ``plan``, or the loader's split when re-splitting to ``plan`` costs more than it
        saves (``note`` says why)."""
        seconds, received = self.estimate
        verdict = exchange_verdict(plan, self.fed_sizes, models, seconds, received)
        self.note = verdict.note
        return verdict.plan

    def moved_since_last_plan(self, steps):
        """A line on what re-splitting moved to this rank per step under the plan that ends at step
        ``steps`` (None when nothing moved), for the plan's log."""
        inputs0, outputs0, since = self._logged
        count = max(steps - since, 1)
        inputs, outputs = (self.input_bytes - inputs0) / count, (self.output_bytes - outputs0) / count
        self._logged = (self.input_bytes, self.output_bytes, steps)
        if not inputs and not outputs:
            return None
        return (f"re-split under the previous plan: this rank received {inputs:,.0f} B of inputs and "
                f"{outputs:,.0f} B of returned outputs per step (resplit_fed_batches; the engine's loader or "
                f"sampler moves nothing)")

    # -- checkpoints -------------------------------------------------------------------------

    def state_dict(self):
        """What decides a re-split, as plain values: rank 0's estimate and the fed sizes."""
        seconds, received = self.estimate
        return {"seconds": seconds, "bytes": received,
                "fed_sizes": None if self.fed_sizes is None else [int(n) for n in self.fed_sizes]}

    def load_state_dict(self, state):
        state = state or {}  # absent from records written before it was kept
        self.estimate = (state.get("seconds"), state.get("bytes"))
        fed = state.get("fed_sizes")
        self.fed_sizes = None if fed is None else tuple(fed)
