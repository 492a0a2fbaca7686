# SPDX-License-Identifier: Apache-2.0
"""Figures quoted twice agree (pure, under a second).

QUOTES pairs a figure that README.md (or a summary paragraph of docs/benchmarks.md) quotes with the
table cell or sentence of docs/benchmarks.md it comes from, or with what that table's rows give (a
ratio of two rows, a range over several). As a backstop, every number of README's capability
table appears in docs/benchmarks.md or in a doc its row links. A failure names the quoting line,
the figure and where the expected value stands.
"""

import re
from dataclasses import dataclass

from doc_sources import BENCHMARKS, README, REPO, rel, render


@dataclass
class Figure:
    """What a quote should read, and where each value comes from."""
    values: tuple
    wheres: tuple


def found(values, where):
    return Figure(tuple(values), (where,) * len(values))


def table_near(doc, section=None, after=None, column=None):
    """The first table of ``doc`` in ``section`` (a heading) and/or after the first line that contains
    ``after``, whose header has ``column``."""
    lines = doc.read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if after in line), None) if after else 0
    assert start is not None, f"{rel(doc)}: no line contains {after!r} any more: update QUOTES in test_doc_figures.py"
    for table in render.tables(lines):
        if table.line >= start and (section is None or table.section == section) and \
                (column is None or column in table.header):
            return table
    raise AssertionError(f"{rel(doc)}: no table{f' in section {section!r}' if section else ''}"
                         f"{f' after {after!r}' if after else ''} with column {column!r}: update QUOTES in test_doc_figures.py")


def label_matches(cell, label):
    return cell == label or bool(re.match(re.escape(label) + r"\W", cell))


def table_cell(doc, row, column, section=None, after=None):
    """``(cell text, where)`` of the row whose first cells start with ``row`` in ``column``."""
    table = table_near(doc, section, after, column)
    row = (row,) if isinstance(row, str) else row
    for offset, cells in enumerate(table.rows):
        if all(label_matches(cell, label) for cell, label in zip(cells, row)):
            where = f"{rel(doc)}:{table.line + 3 + offset} ({table.section}, row {' | '.join(row)}, column {column})"
            return cells[table.header.index(column)].replace("**", ""), where
    raise AssertionError(f"{rel(doc)}:{table.line + 1}: no row {row} in the table of {table.section!r}: "
                         "update QUOTES in test_doc_figures.py")


def lead(cell):
    """The first figure of a cell: '50.2% (`--quick`; ...)' -> '50.2%', '11.9x faster' -> '11.9x'."""
    match = re.search(r"-?x?\d+(?:\.\d+)?(?:%|x)?", cell)
    return match.group(0) if match else cell


def figure(doc, row, column, section=None, after=None, form=lead):
    cell, where = table_cell(doc, row, column, section, after)
    return found([form(cell)], where)


def pieces(doc, row, column, indexes, section=None):
    """Parts of a cell that holds several figures ('55% / 53% / 41%')."""
    cell, where = table_cell(doc, row, column, section)
    return found([cell.split(" / ")[index] for index in indexes], where)


def figures(*parts):
    return Figure(sum((part.values for part in parts), ()), sum((part.wheres for part in parts), ()))


def number(text):
    return float(re.sub(r"[^\d.]", "", lead(text)))


def spread(doc, rows, column, section=None, after=None, unit="%", digits=0):
    """The range 'lo-hi' of a column over rows; rows: (row labels, ...)."""
    cells = [table_cell(doc, row, column, section, after) for row in rows]
    values = [float(v) for cell, _ in cells for v in re.findall(r"\d+(?:\.\d+)?", re.sub(r"\(.*?\)", "", cell))]
    where = f"{cells[0][1].split(' (')[0]} and {len(cells) - 1} more rows ({column})"
    return found([f"{min(values):.{digits}f}-{max(values):.{digits}f}{unit}"], where)


def ratio(doc, over, under, column, after, digits=2):
    """'x0.98': the ratio of two rows' column."""
    (a, where), (b, _) = table_cell(doc, over, column, after=after), table_cell(doc, under, column, after=after)
    return found([f"x{number(a) / number(b):.{digits}f}"], f"{where} over row {' | '.join(under)}")


def same(*parts):
    """One value quoted for several rows: the rows' values must agree."""
    values = {value for part in parts for value in part.values}
    return found([values.pop() if len(values) == 1 else " / ".join(sorted(values))],
                 " and ".join(where for part in parts for where in part.wheres))


def sentence(doc, pattern):
    text = doc.read_text()
    match = re.search(pattern.replace(" ", r"\s+"), text)
    assert match, f"{rel(doc)}: no sentence matches {pattern!r} any more: update QUOTES in test_doc_figures.py"
    return found(match.groups(), f"{rel(doc)}:{text.count(chr(10), 0, match.start()) + 1}")


def rounded(figure_found):
    return Figure(tuple(f"{float(value):.0f}" for value in figure_found.values), figure_found.wheres)


B = BENCHMARKS
FULL_RUN = "A full run (`python tests/perf/bench_overlap.py`"
DILATED = "--dilation 0.25` (about 5 min"
MB12_MODES = [(stage, mode) for stage in ("2", "3") for mode in ("sync", "hier", "coded", "fwd-gather", "fwd-coded",
                                                                   "one-chunk", "gather-all") if
              not (stage == "3" and mode.startswith("fwd")) and not (stage == "2" and mode in ("one-chunk", "gather-all"))]

# (doc, pattern whose groups quote the figures, where they come from). A pattern's spaces match any
# whitespace, so a quote may wrap.
QUOTES = [
    (README, r"ZeRO-0, speeds \[1\.0, 0\.4\]: ([\d.]+%) of the ideal",
     lambda: figure(B, "compute-aware / ideal", "0", section="Compute-aware vs uniform")),
    (README, r"(\d+\.\d+%) of the ideal in the ZeRO-3 benchmark",
     lambda: figure(B, "compute-aware / ideal", "3", section="Compute-aware vs uniform")),
    (README, r"detected in (\d+ of \d+) runs with the default 5 profiling steps",
     lambda: figure(B, "5 (default)", "rank 1 at 0.4: detected", section="Profiling gate", form=str)),
    (README, r"one rebalance, predicted gain ([\d.]+%), observed ([\d.]+%)",
     lambda: sentence(B, r"predicted gain ([\d.]+%), observed ([\d.]+%)")),
    (README, r"collective time per step (\d+) -> (\d+) ms",
     lambda: sentence(B, r"Collective time per step dropped from (\d+) to (\d+) ms")),
    (README, r"rank 1's peak ([\d.]+%) below even slices at the same global batch \(a `--quick` run; ZeRO-1: ([\d.]+%)\)",
     lambda: figures(figure(B, "rank 1's peak below even slices", "ZeRO-2", section="Memory-proportional partitions"),
                     figure(B, "rank 1's peak below even slices", "ZeRO-1", section="Memory-proportional partitions"))),
    (README, r"has ([\d.]+x) the parameters upstream fits \(an MLP\), ([\d.]+x) \(a small GPT\)",
     lambda: figures(figure(B, "MLP", "parameters", section="ZeRO-3 shards"),
                     figure(B, "small GPT", "parameters", section="ZeRO-3 shards"))),
    (README, r"ZeRO-3 NVMe: rank 1's peak (-\d+%), at (\d+%) of the device run's throughput",
     lambda: sentence(B, r"\((-\d+%)\), at (\d+%) of the device run's throughput")),
    (README, r"`auto` within 15% in (\d+ of \d+) runs",
     lambda: sentence(B, r"\((\d+ of \d+) over this session's")),
    (README, r"a quota alone beside busy loops ([\d.]+-[\d.]+x)",
     lambda: spread(B, [("busy", "cgroup")], "achieved (asked 2.5x)", section="Emulation", unit="x", digits=2)),
    (README, r"stretches that unevenly \(([\d.]+-[\d.]+x) for an asked 2\.5x",
     lambda: spread(B, [("busy", "auto"), ("quiet", "dilation"), ("busy", "dilation")], "achieved (asked 2.5x)",
                    section="Emulation", unit="x", digits=2)),
    (README, r"ZeRO-2, 200 Mbit/s: slow-link bytes -(\d+%), step time -(\d+%)",
     lambda: pieces(B, ("2 x 2", "2"), "lower: bytes / comm / step", (0, 2), section="Communication across hosts")),
    (README, r"step (x[\d.]+) \(ZeRO-1/2\) and (x[\d.]+) \(ZeRO-3\) of the hierarchical step in the latest full run",
     lambda: figures(same(ratio(B, ("1", "hier"), ("1", "sync"), "step ms", FULL_RUN),
                          ratio(B, ("2", "hier"), ("2", "sync"), "step ms", FULL_RUN)),
                     ratio(B, ("3", "hier"), ("3", "sync"), "step ms", FULL_RUN))),
    (B, r"overlap takes the step to (x[\d.]+) \(ZeRO-1\), (x[\d.]+) \(ZeRO-2\) and (x[\d.]+) \(ZeRO-3\) of the "
        r"hierarchical step without it, and the exposed communication to (x[\d.]+), (x[\d.]+) and (x[\d.]+); "
        r"the shares are (\d+%), (\d+%) and (\d+%) against (\d+%), (\d+%) and (\d+%) for flat",
     lambda: figures(*[ratio(B, (z, "hier"), (z, "sync"), "step ms", FULL_RUN) for z in "123"],
                     *[ratio(B, (z, "hier"), (z, "sync"), "exposed ms", FULL_RUN) for z in "123"],
                     *[figure(B, (z, "hier"), "share", after=FULL_RUN) for z in "123"],
                     *[figure(B, (z, "flat"), "share", after=FULL_RUN) for z in "123"])),
    (README, r"at 177 Mbit/s the fork's modes stay at (\d+-\d+%) \(flat (\d+-\d+%)\)",
     lambda: figures(spread(B, MB12_MODES, "share", after=FULL_RUN),
                     spread(B, [("1", "flat"), ("2", "flat"), ("3", "flat")], "share", after=FULL_RUN))),
    (B, r"against (\d+-\d+%) at micro-batch 12 \(ZeRO-2/3 in the full-run table above; `hier` (\d+-\d+%)\)",
     lambda: figures(spread(B, MB12_MODES, "share", after=FULL_RUN),
                     spread(B, [("2", "hier"), ("3", "hier")], "share", after=FULL_RUN))),
    (README, r"\(dilated ranks, 100 Mbit/s, flat ZeRO-2 (\d+%)\): ZeRO-3 (\d+%), ZeRO-2 (\d+%) with the parameter gather",
     lambda: figures(*[figure(B, row, "share (repeats)", after=DILATED)
                       for row in (("2", "flat"), ("3", "hier"), ("2", "fwd-gather"))])),
    (README, r"flat ZeRO-2 at (\d+%) of the step\) ZeRO-3's default spends (\d+%) of the step communicating and "
             r"ZeRO-2 (\d+%) with the opt-in `overlap_parameter_gather` \((\d+%) without\)",
     lambda: figures(*[figure(B, row, "share (repeats)", after=DILATED)
                       for row in (("2", "flat"), ("3", "hier"), ("2", "fwd-gather"), ("2", "hier"))])),
    (B, r"ZeRO-3's default \(`hier`: overlap and host shards\) at (\d+%), ZeRO-2 with the parameter gather in the "
        r"next forward \(`overlap_parameter_gather`, opt-in, exact\) at (\d+%), where flat ZeRO-2 is at (\d+%); "
        r"ZeRO-2's default \(`hier`\) stays at (\d+%)",
     lambda: figures(*[figure(B, row, "share (repeats)", after=DILATED)
                       for row in (("3", "hier"), ("2", "fwd-gather"), ("2", "flat"), ("2", "hier"))])),
    (B, r"Overlap takes the step to (x[\d.]+) \(ZeRO-2\) and (x[\d.]+) \(ZeRO-3\) of the hierarchical step without "
        r"it; `fwd-gather` to (x[\d.]+) of `hier`'s",
     lambda: figures(ratio(B, ("2", "hier"), ("2", "sync"), "step ms", DILATED),
                     ratio(B, ("3", "hier"), ("3", "sync"), "step ms", DILATED),
                     ratio(B, ("2", "fwd-gather"), ("2", "hier"), "step ms", DILATED))),
    (B, r"met everywhere except the communication time on 2 \+ 1, (\d+%) lower",
     lambda: pieces(B, ("2 + 1", "2"), "lower: bytes / comm / step", (1,), section="Communication across hosts")),
    (README, r"300 fp16 steps: (\d+) step skipped against upstream's (\d+)",
     lambda: figures(figure(B, "skipped steps", "adaptive", section="Loss scaling"),
                     figure(B, "skipped steps", "dynamic", section="Loss scaling"))),
    (README, r"([\d.]+x) \(fp32\) to ([\d.]+x) \(fp16\) faster than torch's sequence",
     lambda: figures(figure(B, "fp32", "fused vs unfused", section="Fused unscale"),
                     figure(B, "fp16", "fused vs unfused", section="Fused unscale"))),
    (README, r"fast mode: (\d+ of \d+) grid experiments, ([\d.]+x) the best uniform configuration",
     lambda: figures(figure(B, ("emulated", "fast"), "experiments (grid)", section="Autotuning",
                            form=lambda cell: re.sub(r"(\d+) \((\d+)\)", r"\1 of \2", cell)),
                     figure(B, ("emulated", "fast"), "vs best uniform", section="Autotuning"))),
    (README, r"2 stages at \[1\.0, 0\.5\]: ([\d.]+x-[\d.]+x) over upstream's `parameters` cut",
     lambda: sentence(B, r"2 stages at \[1\.0, 0\.5\] got ([\d.]+x-[\d.]+x) over")),
    (README, r"200 Mbit/s emulated link, ([\d.]+x) ZeRO-3's samples/s with (1/\d+) of its bytes",
     lambda: sentence(B, r"trained ([\d.]+x) as fast as ZeRO-3 data parallelism of the same blocks, with (1/\d+) of")),
    (README, r"the survivors finish by themselves in (\d+) s of recovery",
     lambda: rounded(sentence(B, r"recovered in \*\*([\d.]+) s\*\*"))),
]


def test_quoted_figures_agree_with_their_source():
    failures = []
    for doc, pattern, source in QUOTES:
        text = doc.read_text()
        matches = list(re.finditer(pattern.replace(" ", r"\s+"), text))
        if not matches:
            failures.append(f"{rel(doc)}: no text matches {pattern!r} any more: if the figure moved, update QUOTES "
                            "in tests/unit/test_doc_figures.py")
            continue
        expected = source()
        for match in matches:
            line = text.count("\n", 0, match.start()) + 1
            for quoted, value, where in zip(match.groups(), expected.values, expected.wheres):
                if quoted != value:
                    failures.append(f"{rel(doc)}:{line}: quotes {quoted} where {where} gives {value}")
    assert not failures, "\n".join(failures)


def capability_rows():
    lines = README.read_text().splitlines()
    table = next(t for t in render.tables(lines) if t.header[:2] == ["capability", "current measured figure"])
    return [(table.line + 3 + offset, cells) for offset, cells in enumerate(table.rows)]


def test_capability_figures_appear_in_the_docs_they_cite():
    """A backstop for figures QUOTES does not pair: each number of a capability row's figure is in
    docs/benchmarks.md or in a doc the row links."""
    failures = []
    for line, cells in capability_rows():
        docs = [BENCHMARKS] + [REPO / link for link in re.findall(r"\]\((docs/[\w.-]+\.md)", cells[-1])]
        text = "\n".join(doc.read_text() for doc in docs)
        for figure_text in re.findall(r"(?<![\w.])(x?\d+(?:\.\d+)?(?:e-?\d+)?(?:%|x)?)(?![\w.]\d|\w)", cells[1]):
            if not re.search(r"(?<![\w.])" + re.escape(figure_text) + r"(?![\d]|\.\d|\w)", text):
                failures.append(f"README.md:{line}: {figure_text} ({cells[0][:50]}...) is in none of "
                                f"{', '.join(rel(doc) for doc in docs)}")
    assert not failures, "\n".join(failures)
