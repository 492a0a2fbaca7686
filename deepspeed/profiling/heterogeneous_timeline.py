# SPDX-License-Identifier: Apache-2.0
"""The heterogeneous profiler's PNG timeline (docs/profiler.md#the-timeline), from the metrics
``heterogeneous_metrics.compute_metrics`` returns (or ``load_metrics`` reads back).

One row per data-parallel rank, one column per optimizer step, as wide as the step's time; the
step numbers are the bottom axis, the seconds the top one. Each step holds the rank's busy,
waiting and transfer seconds side by side (totals of the step, not the order in which they
happened); what is left of the step is white: time the profiler did not record for that rank.
Each plan change (a rebalance) and each speed change of a rank is a vertical line with its label
inside the plot, above the ranks, in as many rows as the labels need not to overlap.

``timeline_figure`` returns the matplotlib figure (the tests read its ticks, texts and legend);
``draw_timeline`` writes it as a PNG. Both need matplotlib (3.7 or newer: the legend sits outside
the axes by the constrained layout), imported only inside them; the device names' shortening does
not.
"""

import collections
import re

__all__ = ["GAP_LABEL", "describe_speed_change", "draw_timeline", "short_device_name", "timeline_figure"]

GAP_LABEL = "white: not recorded (data loading, the training loop)"
MAX_STEP_LABELS = 20  # more steps than this: every k-th step start is labelled, the rest get a minor tick

_SPANS = (("busy_s", "compute (forward, backward, optimizer)", "tab:green"),
          ("waiting_s", "waiting for slower ranks", "tab:orange"),
          ("transfer_s", "transfer (collectives)", "tab:blue"))
_REBALANCE_COLOUR, _SPEED_COLOUR = "tab:red", "tab:purple"
# A vertical line with its label: ``gid`` names the label's kind for the tests ("rebalance",
# "speed-change"); ``rank``, the rank whose speed changed (None for a plan change).
_Mark = collections.namedtuple("_Mark", "x label colour style gid rank")
_FONT_SIZE = 8
_LABEL_BOX = {"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 1}  # a line under a label stays legible
_LANE_HEIGHT = 0.45  # in rank rows; a row is ROW_INCHES tall
_ROW_INCHES = 0.7

# Words of CPU and GPU model names that do not tell two devices apart on a chart's axis.
_NAME_NOISE = re.compile(
    r"\((?:R|TM|C)\)|@\s*[\d.]+\s*[GM]Hz|\b(?:Intel|AMD|NVIDIA|Genuine|GeForce|Tesla|Processor|CPU|Platinum|Gold|"
    r"Silver|Bronze|Core|\d+-Core|with Radeon Graphics)\b", re.IGNORECASE)
_CPU_WORDS = re.compile(r"\b(?:CPU|Processor|Xeon|EPYC|Ryzen|Threadripper|Core|Opteron|Neoverse|Graviton)\b|^cpu$",
                        re.IGNORECASE)


def short_device_name(name, limit=18):
    """A device model name short enough for an axis label: vendor words, trademarks and clock
    rates left out, ``CPU (...)`` around a CPU's model, cut at ``limit`` characters with an
    ellipsis. ``"Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz"`` -> ``"CPU (Xeon 8375C)"``,
    ``"NVIDIA A100-SXM4-80GB"`` -> ``"A100-SXM4-80GB"``; None or ``"-"`` (unknown) -> ``""``.
    The metrics (and the JSON) keep the full name."""
    if not name or name == "-":
        return ""
    is_cpu = bool(_CPU_WORDS.search(name))
    model = " ".join(_NAME_NOISE.sub(" ", name).split())
    room = limit - len("CPU ()") if is_cpu else limit
    if len(model) > room:
        model = model[:room - 1].rstrip() + "\u2026"
    if is_cpu:
        return f"CPU ({model})" if model and model.lower() != "cpu" else "CPU"
    return model or name[:limit]


def _percent(value):
    return "-" if value is None else f"{100 * value:.1f}%"


def _rank_label(rank):
    short = short_device_name(rank.get("device"))
    return f"rank {rank['rank']} \u00b7 {short}" if short else f"rank {rank['rank']}"


def _step_starts(metrics):
    starts, now = [], 0.0
    for seconds in metrics["step_time_s"]:
        starts.append(now)
        now += seconds
    return starts, now


def describe_speed_change(change, arrow="->", times="x"):
    """One line for a speed change of the metrics (``speed_changes``), e.g. ``rank 1 from step 12:
    speed 1 -> 0.4 asked, 2.6x slower measured`` (the timeline passes the typographic arrow and
    multiplication sign)."""
    asked, factor = change.get("asked_speeds"), change.get("measured_factor")
    measured = None
    if factor is not None:
        measured = f"{factor:.2g}{times} slower" if factor >= 1 else f"{1 / factor:.2g}{times} faster"
    head = f"rank {change['rank']} from step {change['step']}: "
    if asked is None:
        return head + f"{measured} (measured)"
    speeds = f"speed {asked[0]:g} {arrow} {asked[1]:g} asked"
    return head + speeds + (f", {measured} measured" if measured else ", no change measured")


def _marks(metrics, starts, total):
    """A ``_Mark`` for each plan change and speed change in the window, from left to right."""
    steps = metrics["steps"]
    ends = starts[1:] + [total]
    marks = []
    for event in metrics.get("rebalance_events") or []:
        if event["step"] in steps:  # the new plan runs from the next step: the line ends this one
            label = (f"rebalance after step {event['step']}: {list(event['old_sizes'])} \u2192 "
                     f"{list(event['new_sizes'])}")
            marks.append(_Mark(ends[steps.index(event["step"])], label, _REBALANCE_COLOUR, "--", "rebalance", None))
    for change in metrics.get("speed_changes") or []:
        if change["step"] in steps:
            label = describe_speed_change(change, "\u2192", "\u00d7")
            marks.append(_Mark(starts[steps.index(change["step"])], label, _SPEED_COLOUR, ":", "speed-change",
                               change["rank"]))
    return sorted(marks, key=lambda mark: mark.x)


def _lane_y(lane):
    return -0.62 - _LANE_HEIGHT * lane


def _fit_labels(figure, axes, texts, anchors, total):
    """Put each label beside its line, inside the axes (left of the line where the right edge is
    near), in the first lane where it overlaps no other label; returns the number of lanes."""
    renderer = figure.canvas.get_renderer()
    per_pixel = total / axes.get_window_extent(renderer).width
    pad = 3 * per_pixel
    lane_ends = []
    for text, anchor in zip(texts, anchors):
        width = text.get_window_extent(renderer).width * per_pixel
        left = anchor + pad if anchor + pad + width <= total - pad else anchor - pad - width
        left = min(max(left, pad), max(total - pad - width, pad))
        lane = next((i for i, end in enumerate(lane_ends) if end + 2 * pad <= left), len(lane_ends))
        if lane == len(lane_ends):
            lane_ends.append(0.0)
        lane_ends[lane] = left + width
        text.set_position((left, _lane_y(lane)))
    return len(lane_ends)


def _draw_ranks(axes, ranks, starts):
    """Each rank's row: per step its busy, waiting and transfer seconds side by side from the
    step's start, the rest white; a thin grey line between steps."""
    for row, rank in enumerate(ranks):
        spans = {key: [] for key, _, _ in _SPANS}
        for start, entry in zip(starts, rank["timeline"]):
            at = start
            for key, _, _ in _SPANS:
                seconds = max(entry[key], 0.0)
                spans[key].append((at, seconds))
                at += seconds
        for key, _, colour in _SPANS:
            axes.broken_barh(spans[key], (row - 0.35, 0.7), facecolors=colour)
    for start in starts[1:]:
        axes.axvline(start, color="0.85", linewidth=0.5, zorder=0)


def timeline_figure(metrics):
    """The timeline of ``metrics`` (as ``get_metrics()`` or ``load_metrics()`` gives them) as a
    matplotlib ``Figure`` on the Agg canvas; pyplot's global state is left alone. Needs matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise ImportError("HeterogeneousProfiler.save_timeline() draws with matplotlib, which is not installed: "
                          "pip install matplotlib") from exc
    ranks = metrics["ranks"]
    steps = metrics["steps"]
    starts, total = _step_starts(metrics)
    total = total or 1.0
    figure = Figure(figsize=(10, 2.4 + _ROW_INCHES * len(ranks)), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    _draw_ranks(axes, ranks, starts)
    marks = _marks(metrics, starts, total)
    texts = []
    for mark in marks:
        axes.axvline(mark.x, color=mark.colour, linestyle=mark.style, linewidth=1.2, zorder=3)
        if mark.rank is not None:  # which rank changed speed: a marker on its row
            axes.plot([mark.x], [mark.rank - 0.42], marker="v", color=mark.colour, markersize=6, zorder=4)
        text = axes.text(mark.x, _lane_y(0), mark.label, color=mark.colour, fontsize=_FONT_SIZE, va="center",
                         ha="left", zorder=5, bbox=_LABEL_BOX)
        text.set_gid(mark.gid)
        texts.append(text)

    labelled = range(0, len(steps), -(-len(steps) // MAX_STEP_LABELS))
    axes.set_xticks([starts[i] for i in labelled], [str(steps[i]) for i in labelled])
    axes.set_xticks(starts, minor=True)
    axes.set_xlabel("optimizer step (each tick at the step's start)")
    seconds_axis = axes.secondary_xaxis("top")
    seconds_axis.set_xlabel("seconds since the first profiled step", fontsize=_FONT_SIZE)
    seconds_axis.tick_params(labelsize=_FONT_SIZE)
    axes.set_yticks(range(len(ranks)), [_rank_label(rank) for rank in ranks])
    axes.set_xlim(0, total)
    axes.set_ylim(len(ranks) - 0.3, -0.7)
    axes.set_title(f"steps {steps[0]}-{steps[-1]}: heterogeneous utilisation "
                   f"{_percent(metrics['heterogeneous_utilization'])}, communication "
                   f"{_percent(metrics['communication_share'])}", fontsize=10)
    handles = [Patch(facecolor=colour, label=label) for _, label, colour in _SPANS]
    handles.append(Patch(facecolor="white", edgecolor="0.5", label=GAP_LABEL))
    if any(mark.gid == "rebalance" for mark in marks):
        handles.append(Line2D([], [], color=_REBALANCE_COLOUR, linestyle="--", label="plan change (rebalance)"))
    if any(mark.gid == "speed-change" for mark in marks):
        handles.append(Line2D([], [], color=_SPEED_COLOUR, linestyle=":", marker="v",
                              label="speed change (asked by the emulation or measured)"))
    figure.legend(handles=handles, loc="outside lower center", ncols=3, fontsize=_FONT_SIZE, frameon=False)

    if texts:
        figure.canvas.draw()  # the layout sets the axes' width, which the labels' widths are measured against
        lanes = _fit_labels(figure, axes, texts, [mark.x for mark in marks], total)
        axes.set_ylim(len(ranks) - 0.3, _lane_y(lanes - 1) - 0.3)
        width, height = figure.get_size_inches()
        figure.set_size_inches(width, height + _ROW_INCHES * _LANE_HEIGHT * lanes)
        figure.canvas.draw()
        lanes = _fit_labels(figure, axes, texts, [mark.x for mark in marks], total)  # the final layout's width
        axes.set_ylim(len(ranks) - 0.3, _lane_y(lanes - 1) - 0.3)
    return figure


def draw_timeline(metrics, path):
    """Write the PNG timeline of ``metrics`` to ``path`` (see ``timeline_figure``); returns ``path``.
    Needs matplotlib."""
    timeline_figure(metrics).savefig(path, format="png", dpi=110)
    return path
