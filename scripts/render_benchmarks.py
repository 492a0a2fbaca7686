#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Rewrite the docs' measured tables from the benchmarks' JSON: python scripts/render_benchmarks.py

    python scripts/render_benchmarks.py [--check] [--results tests/perf/results]

A table between ``<!-- results: NAME.json [NAME.json ...] -->`` and ``<!-- /results -->`` in
README.md or docs/*.md is rendered from those files of tests/perf/results/ (the benchmarks write
them; the ones the docs quote are committed) by the renderer RENDERERS registers for the name.
Figures copied into prose by hand drift from their runs; a rendered table cannot.
``tests/unit/test_docs.py`` fails when a marked table differs from what this script renders.

It prints each marked table (rewritten, unchanged, or its JSON missing: left as it is) and then
every measured table that is still hand-written: a table of docs/benchmarks.md, README's
capability table, or a table in a section that names a benchmark. Those have no JSON in the
repository (earlier runs); a run of the benchmark, a renderer and a marker would make them rendered.
``--check`` writes nothing and exits 1 when a marked table would change.
"""

import argparse
import fnmatch
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "tests" / "perf" / "results"
MARKER = re.compile(r"^<!-- results: (?P<names>[\w.-]+(?: [\w.-]+)*) -->$")
END_MARKER = "<!-- /results -->"
HEADING = re.compile(r"^(#{1,6}) (.*)$")
BENCH = re.compile(r"\b(bench_\w+\.py)\b")
MIB = 2**20


def doc_paths(root=REPO):
    """The documents whose tables are rendered and listed: README.md and docs/*.md."""
    return [root / "README.md"] + sorted((root / "docs").glob("*.md"))


# ---- markdown --------------------------------------------------------------------------------


def split_row(line):
    """The cells of a table row, split at ``|`` outside backticks, stripped."""
    cells, current, in_code = [], "", False
    for char in line.strip().strip("|"):
        if char == "`":
            in_code = not in_code
        if char == "|" and not in_code:
            cells.append(current.strip())
            current = ""
        else:
            current += char
    return cells + [current.strip()]


@dataclass
class Table:
    """A markdown table: its first line's index, its header cells and its body rows (cells)."""
    line: int
    header: list
    rows: list
    section: str
    end: int


def headings(lines):
    """``[heading text or None per line]``: the nearest heading above each line, outside fences."""
    current, fenced, result = None, False, []
    for line in lines:
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and HEADING.match(line):
            current = HEADING.match(line).group(2).strip()
        result.append(current)
    return result


def tables(lines):
    """Every table of a document (``lines``: its lines), in order."""
    found, sections, index, fenced = [], headings(lines), 0, False
    while index < len(lines):
        line = lines[index]
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if (not fenced and line.startswith("|") and index + 1 < len(lines)
                and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[index + 1].strip())):
            end = index + 2
            while end < len(lines) and lines[end].startswith("|"):
                end += 1
            found.append(Table(index, split_row(line), [split_row(row) for row in lines[index + 2:end]],
                               sections[index], end))
            index = end
            continue
        index += 1
    return found


# ---- marked tables ---------------------------------------------------------------------------


@dataclass
class Marked:
    """A marked region: the marker's line index, the JSON names, and the lines between the markers."""
    doc: Path
    line: int
    names: list
    end: int
    text: str


def marked_regions(path, lines=None):
    """The ``<!-- results: ... -->`` regions of one document; an unclosed marker is an error."""
    lines = path.read_text().splitlines() if lines is None else lines
    regions = []
    for index, line in enumerate(lines):
        match = MARKER.match(line.strip())
        if not match:
            continue
        end = next((j for j in range(index + 1, len(lines))
                    if lines[j].strip() == END_MARKER or MARKER.match(lines[j].strip())), None)
        if end is None or lines[end].strip() != END_MARKER:
            raise ValueError(f"{path.name}:{index + 1}: '{line.strip()}' has no '{END_MARKER}' before the next marker")
        regions.append(Marked(path, index, match["names"].split(), end, "\n".join(lines[index + 1:end])))
    return regions


def renderer_for(names):
    """The renderer every name of a marker maps to (one for all of them), or ValueError."""
    found = []
    for name in names:
        matching = {fn for pattern, fn in RENDERERS.items() if fnmatch.fnmatch(name, pattern)}
        if len(matching) != 1:
            raise ValueError(f"no renderer for {name} (registered: {', '.join(RENDERERS)})")
        found.append(matching.pop())
    if len(set(found)) != 1:
        raise ValueError(f"{' '.join(names)} belong to different renderers: one marker, one benchmark")
    return found[0]


def render(names, results=RESULTS):
    """The markdown a marker's JSON renders to, or None when one of its files is missing."""
    renderer = renderer_for(names)
    paths = [Path(results) / name for name in names]
    if not all(path.exists() for path in paths):
        return None
    return renderer([json.loads(path.read_text()) for path in paths])


def rewrite(path, results=RESULTS):
    """``(new text, [(region, status)])`` for one document; status: rendered, unchanged, missing JSON."""
    text = path.read_text()
    lines = text.splitlines()
    report = []
    # From the last region up, so that earlier line numbers stay valid while lines change.
    for region in reversed(marked_regions(path, lines)):
        rendered = render(region.names, results)
        if rendered is None:
            report.append((region, "JSON missing: left as it is"))
            continue
        report.append((region, "unchanged" if rendered == region.text else "rewritten"))
        lines[region.line + 1:region.end] = rendered.splitlines()
    return "\n".join(lines) + ("\n" if text.endswith("\n") else ""), list(reversed(report))


def hand_written_tables(path):
    """The measured tables of a document outside any marker: ``[(table, [benches its section names])]``."""
    lines = path.read_text().splitlines()
    covered = set()
    for region in marked_regions(path, lines):
        covered.update(range(region.line, region.end))
    sections = headings(lines)
    found = []
    for table in tables(lines):
        if table.line in covered:
            continue
        # The section's text up to the table: the bench it names, if any.
        start = max((i for i in range(table.line) if sections[i] != sections[table.line]), default=-1) + 1
        benches = list(dict.fromkeys(BENCH.findall("\n".join(lines[start:table.line]))))
        capability = path.name == "README.md" and table.header[:2] == ["capability", "current measured figure"]
        if path.name == "benchmarks.md" or capability or benches:
            found.append((table, benches))
    return found


# ---- renderers: one per benchmark's JSON -----------------------------------------------------


def _plans(runs):
    """The plan of a list of runs: one when they agree, else each, separated by ' / '."""
    plans = [str(run["plan"]) for run in runs]
    return plans[0] if len(set(plans)) == 1 else " / ".join(plans)


def _shares(shares, digits):
    return "even" if not shares or len(set(shares)) == 1 else "(" + ", ".join(f"{s:.{digits}f}" for s in shares) + ")"


def render_activation_room(results):
    """bench_activation_room.py, one row per global batch (activation_room_b<batch>.json)."""
    lines = ["| global batch | unbound | shares alone | together (the measured estimate) |", "| --- | --- | --- | --- |"]
    for index, result in enumerate(sorted(results, key=lambda r: r["global_batch"])):
        unit = " samples/s" if index == 0 else ""
        cells = [str(result["global_batch"]),
                 f"{_plans(result['runs']['unbound'])}, {result['medians']['unbound']:.1f}{unit}"]
        for mode in ("alone", "together"):
            runs = result["runs"][mode]
            cells.append(f"{_shares(runs[0]['shares'], 3)}, {_plans(runs)}, {result['medians'][mode]:.1f} "
                         f"({result['ratios_to_unbound'][mode]:.2f}x)")
        lines.append("| " + " | ".join(cells) + " |")
    checks = []
    for result in sorted(results, key=lambda r: r["global_batch"]):
        for mode, check in sorted((result.get("forecast_check") or {}).items()):
            other = "together" if mode == "alone" else "alone"
            checks.append(f"at {result['global_batch']}, `{mode}` forecast its own step {check['own_forecast_s']:.2f} s "
                          f"(measured {check['own_measured_s']:.2f} s) and `{other}`'s {check['other_forecast_s']:.2f} s "
                          f"(measured {check['other_measured_s']:.2f} s, {check['other_error']:+.0%}), and its advice "
                          f"was `{check['advice']}`")
    if checks:
        loads = [run["load_average"] for result in results for runs in result["runs"].values() for run in runs]
        lines += ["", "After profiling, " + "; ".join(checks) + f" (load average {min(loads):.1f} to "
                  f"{max(loads):.1f} during the runs)."]
    return "\n".join(lines)


def render_autotuning_pruning(results):
    """bench_autotuning.py --pruning: fast mode with and without plan pruning (autotuning_pruning.json)."""
    result = results[0]
    lines = ["| run | fast mode | experiments run | pruned | chosen (ZeRO stage, micro-batches) | its samples/s | "
             "tuning s |", "| --- | --- | --- | --- | --- | --- | --- |"]
    runs = result["runs"]
    for index in range(max(len(rows) for rows in runs.values())):
        for mode in ("fast", "fast_unpruned"):
            if index >= len(runs[mode]):
                continue
            row = runs[mode][index]
            chosen = row.get("chosen") or {}
            label = "plan pruning (default)" if mode == "fast" else "`plan_pruning: false`"
            lines.append(f"| {index + 1} | {label} | {row['experiments_run']} | "
                         f"{', '.join(row.get('pruned') or []) or '-'} | ZeRO-{chosen.get('stage')}, "
                         f"{chosen.get('micro_batch_sizes')} | {row['best_throughput']:.1f} | "
                         f"{row['tuning_seconds']:.0f} |")
    stages = {name.split("_")[0] for row in runs["fast"] for name in row.get("pruned") or []}
    measured = [(experiment["name"], experiment["value"],
                 max(e["value"] for e in row["experiments"] if e["value"] is not None))
                for row in runs["fast_unpruned"] for experiment in row["experiments"]
                if experiment["name"].split("_")[0] in stages and experiment["value"] is not None]
    if measured:
        below = ", ".join(f"`{name}` {value:.1f} samples/s ({1 - value / best:.0%} below that run's best)"
                          for name, value, best in measured)
        lines += ["", f"The stage pruned, as the runs without pruning measured it: {below}. Load average "
                  f"{result['load_average']['start'][0]:.1f} at the start, {result['load_average']['end'][0]:.1f} at "
                  f"the end; {result['total_wall_seconds']:.0f} s."]
    return "\n".join(lines)


MEMORY_MODEL_HF_ROWS = {
    "hf-3-fp32-adam": "ZeRO-3, re-cut by the engine",
    "hf-lora-3-fp32-adam": "LoRA r=8 on `c_attn`, `c_proj`, gradient checkpointing",
    "hf-lora-2-fp32-adam": "the same, ZeRO-2",
}


def render_memory_model_hf(results):
    """bench_memory_model.py --hf: measured / predicted peak per rank (memory_model_hf.json)."""
    by_row = {}
    for entry in results[0]["results"]:
        by_row.setdefault(entry["row"], {})[entry["rank"]] = entry
    ranks = sorted({rank for entries in by_row.values() for rank in entries})
    lines = ["| row | shares | " + " | ".join(f"rank {rank}" for rank in ranks) + " |",
             "| --- | --- | " + " | ".join("---" for _ in ranks) + " |"]
    for row, entries in by_row.items():
        label = f"`{row}`" + (f" ({MEMORY_MODEL_HF_ROWS[row]})" if row in MEMORY_MODEL_HF_ROWS else "")
        cells = [label, _shares(next(iter(entries.values())).get("shares"), 2)]
        for rank in ranks:
            entry = entries.get(rank)
            cells.append("failed" if not entry or "ratio" not in entry else
                         f"{entry['measured'] / MIB:.0f} / {entry['predicted'] / MIB:.0f} MiB, {entry['ratio']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


ZERO3_CAPACITY_MODELS = {  # model -> (first column, the size's symbol)
    "mlp": ("MLP, 12 x Linear(W, W)", "W"),
    "gpt": ("small GPT, L layers (vocabulary 8192, width 384)", "L"),
    "hf-gpt2": ("GPT-2 through the front door: `TrainingArguments` with ZeRO-3, `AutoModelForCausalLM.from_config` "
                "under `zero.Init`, the stock `Trainer`, limits set from outside before the model is built "
                "(vocabulary 8192, width 384, L layers)", "L"),
}


def _capacity_cell(side, symbol, fork):
    if side["size"] is None:
        return "nothing trained"
    failures = sorted((t["size"], t["outcome"]) for t in side["trials"]
                      if t["outcome"] != "trained" and t["size"] > side["size"])
    cell = f"{symbol} = {side['size']}, {side['parameters'] / 1e6:.1f}M"
    if fork:
        shares = "even slices" if not side["shares"] else \
            "shares (" + ", ".join(f"{round(s, 3):g}" for s in side["shares"]) + ")"
        cell += f", {shares}, peaks " + " / ".join(f"{peak:.0f}" for peak in side["peaks_mib"]) + " MiB"
    return cell + (f" ({failures[0][0]} {failures[0][1]})" if failures else "")


def render_zero3_capacity(results):
    """bench_zero3_capacity.py: the largest model each side trains (zero3_capacity.json)."""
    order = list(ZERO3_CAPACITY_MODELS)
    lines = ["| model | upstream (equal slices) | the fork (`\"auto\"`, compute-aware) | parameters |",
             "| --- | --- | --- | --- |"]
    for row in sorted(results[0], key=lambda r: order.index(r["model"]) if r["model"] in order else len(order)):
        label, symbol = ZERO3_CAPACITY_MODELS.get(row["model"], (row["model"], "size"))
        lines.append(f"| {label} | {_capacity_cell(row['upstream'], symbol, False)} | "
                     f"{_capacity_cell(row['fork'], symbol, True)} | {row['ratio']:.2f}x |")
    return "\n".join(lines)


def _ms(seconds):
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


def render_planner(results):
    """bench_planner.py: the planner alone, then deepspeed plan's whole plan against ranks (planner.json)."""
    result = results[0]
    load = result.get("load_average")
    load = f"{load[0]:.1f}" if isinstance(load, list) else "-"
    lines = ["| what is planned | ranks | hosts | time per plan (median) | CPU time | per rank | load |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in result["rows"]:
        gas = "on" if row["per_rank_gas"] else "off"
        lines.append(f"| the planner alone (`plan_micro_batches`), per-rank gas {gas} | {row['ranks']} | - | "
                     f"{_ms(row['median_s'])} | - | - | {load} |")
    for row in result.get("cluster_rows", []):
        lines.append(f"| `plan_cluster` (the fork picks ZeRO-{row['fork_zero_stage']}, gas {row['fork_gas']}: "
                     f"{row['speedup']:.2f}x upstream) | {row['ranks']} | {row['hosts']} | {_ms(row['median_s'])} | "
                     f"{_ms(row.get('median_cpu_s'))} | {row['us_per_rank']:.0f} us | "
                     f"{row.get('load_average', 0):.1f} |")
    return "\n".join(lines)


CONTROL_PLANE_PHASES = ("settings agreement", "device gather", "topology probe", "memory baselines", "process groups",
                        "profiling gather", "plan broadcast")
"""The phases shown; the profiling step's agreement is timed as a whole (under profiling gather)."""


def _bytes(value):
    return f"{value / 2**20:.1f} MiB" if value >= 2**20 else f"{value / 1024:.1f} KiB" if value >= 1024 else \
        f"{value:.0f} B"


def _line_fit(points):
    """Least squares ``y = a + b * x`` through ``points``: (a, b)."""
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    spread = sum((x - mean_x)**2 for x, _ in points)
    b = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread else 0.0
    return mean_y - b * mean_x, b


def render_control_plane(results):
    """bench_control_plane.py: each start-up phase against N (time, bytes a rank receives), then each
    phase's growth fitted as a + b * N and extrapolated to 1,024 and 10,000 ranks (control_plane.json)."""
    rows = results[0]["rows"]
    lines = ["| N (hosts) | `deepspeed.initialize` | " + " | ".join(CONTROL_PLANE_PHASES) + " | load |",
             "| --- | --- | " + " | ".join("---" for _ in CONTROL_PLANE_PHASES) + " | --- |"]
    for row in rows:
        cells = [f"{row['ranks']} ({row['hosts']})", _ms(row["initialize_s"])]
        for name in CONTROL_PLANE_PHASES:
            phase = row["phases"][name]
            parts = [] if name == "plan broadcast" else [_ms(phase["seconds"])]
            if phase["bytes_received_per_rank"]:
                parts.append(_bytes(phase["bytes_received_per_rank"]))
            if name == "settings agreement":
                parts.append(f"{phase['store_calls_rank0']} store calls")
            if name == "process groups":
                parts.append(f"groups: {phase['calls']}")
            cells.append(", ".join(parts))
        cells.append(f"{row['load_average'][0]:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    last = rows[-1]
    lines += ["", f"| phase | collectives per rank (N = {last['ranks']}) | store calls on rank 0 | bytes received "
              "(fit over N) | at 1,024 ranks | at 10,000 ranks |", "| --- | --- | --- | --- | --- | --- |"]
    for name in CONTROL_PLANE_PHASES:
        phase = last["phases"][name]
        rounds = str(phase["rounds"])
        if phase["point_to_point_messages"]:
            rounds += f", and {phase['point_to_point_messages']} point-to-point messages on host 0's leader"
        quantity, who = "bytes_received_per_rank", "a rank"
        if name == "settings agreement":
            quantity, who = "store_bytes_rank0", "rank 0, from the store"
        if name == "process groups":
            rounds = "none; groups created: " + ", ".join(str(row["phases"][name]["calls"]) for row in rows)
        a, b = _line_fit([(row["ranks"], row["phases"][name][quantity]) for row in rows])
        formula = "0" if abs(a) < 0.5 and abs(b) < 0.05 else f"{a:.0f} + {b:.1f} * N B ({who})"
        at = ["-" if formula == "0" else _bytes(a + b * n) for n in (1024, 10000)]
        lines.append(f"| {name} | {rounds} | {phase['store_calls_rank0']} | {formula} | {at[0]} | {at[1]} |")
    return "\n".join(lines)


def _pct(value):
    return "-" if value is None else f"{value:+.1%}"


def render_plan_accuracy(results):
    """bench_plan_accuracy.py: deepspeed plan's predictions against the same runs measured
    (plan_accuracy.json): step time, the worst rank's peak memory, bytes per step over the slow link."""
    result = results[0]
    lines = ["| row | step time: predicted / measured | error | peak memory (worst rank): predicted / measured "
             "| error | slow-link bytes per step: predicted / measured | error |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in result["rows"]:
        predicted, measured = row["predicted"], row["measured"]
        worst = row["memory_errors"].index(row["memory_error"])
        lines.append(f"| {row['label']} | {predicted['step_s']:.2f} / {measured['step_s']:.2f} s | "
                     f"{_pct(row['step_time_error'])} | {predicted['peak_bytes'][worst] / MIB:.1f} / "
                     f"{measured['peak_bytes'][worst] / MIB:.1f} MiB (rank {worst}) | {_pct(row['memory_error'])} | "
                     f"{predicted['bytes_per_step'] / 1e6:.2f} / {measured['bytes_per_step'] / 1e6:.2f} MB | "
                     f"{_pct(row['bytes_error'])} |")
    steps = sorted(abs(row["step_time_error"]) for row in result["rows"])
    middle = len(steps) // 2
    median = steps[middle] if len(steps) % 2 else (steps[middle - 1] + steps[middle]) / 2
    memory = [error for row in result["rows"] for error in row["memory_errors"]]
    load = result.get("load_average", {})
    lines += ["", f"Step time, absolute error: median {median:.1%} (goal 10%), worst {steps[-1]:.1%} (goal 20%). "
              f"Memory, every rank: from {min(memory):+.1%} to {max(memory):+.1%} (goal: within 10%, never more than "
              f"5% under). Bytes: worst {max(abs(row['bytes_error']) for row in result['rows']):.1%} (goal 5%). "
              f"Load average {load.get('before', [0])[0]:.1f} before, {load.get('after', [0])[0]:.1f} after; "
              f"{result['seconds']:.0f} s."]
    return "\n".join(lines)


RENDERERS = {
    "activation_room_b*.json": render_activation_room,
    "autotuning_pruning.json": render_autotuning_pruning,
    "plan_accuracy.json": render_plan_accuracy,
    "control_plane.json": render_control_plane,
    "planner.json": render_planner,
    "memory_model_hf.json": render_memory_model_hf,
    "zero3_capacity.json": render_zero3_capacity,
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when a marked table would change")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the benchmarks' JSON folder")
    args = parser.parse_args(argv)
    stale = 0
    print("marked tables:")
    for path in doc_paths():
        new_text, report = rewrite(path, args.results)
        for region, status in report:
            print(f"  {path.relative_to(REPO)}:{region.line + 1}  {' '.join(region.names)}: {status}")
            stale += status == "rewritten"
        if not args.check and new_text != path.read_text():
            path.write_text(new_text)
    print("hand-written measured tables (no JSON in the repository; a run, a renderer and a marker would render them):")
    for path in doc_paths():
        for table, benches in hand_written_tables(path):
            print(f"  {path.relative_to(REPO)}:{table.line + 1}  {table.section}" + (f"  ({', '.join(benches)})" if benches else ""))
    if args.check and stale:
        print(f"{stale} marked table(s) differ from their JSON: run python scripts/render_benchmarks.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
