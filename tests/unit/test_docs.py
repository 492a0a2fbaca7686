# SPDX-License-Identifier: Apache-2.0
"""The docs agree with the measurements and with the config code (pure, a few seconds).

- Every table marked ``<!-- results: NAME.json -->`` equals what ``scripts/render_benchmarks.py``
  renders from tests/perf/results/NAME.json, and every committed results JSON has a marked table.
- docs/configuration.md lists every key of the fork's pydantic blocks (config/blocks.py) with its
  default and, for a key of fixed words, each word; it lists no key the blocks lack; its opening and
  blocks.py's docstring name every sub-block.

Each failure names the doc, the line and the expected value. The paths, keys and anchors the docs
name are checked by test_doc_names.py, figures quoted twice by test_doc_figures.py.
"""

import ast
import itertools
import json
import re
from dataclasses import dataclass

import pytest

from doc_sources import CONFIGURATION, DOCS, REPO, block_tree, literal_words, rel, render, sub_model, tracked_files


# ---- marked tables against their JSON ------------------------------------------------------

# Committed results that no table renders yet, and why (a marker would make them rendered).
AWAITING_MARKER = {}


def difference(doc, region, expected):
    """One line per differing line of a marked region: where, what it should read, what it reads."""
    lines = []
    for offset, (want, have) in enumerate(itertools.zip_longest(expected.splitlines(), region.text.splitlines(),
                                                                fillvalue="")):
        if want == have:
            continue
        where = f"{doc}:{region.line + 2 + offset}"
        cells_want, cells_have = render.split_row(want), render.split_row(have)
        if want.startswith("|") and have.startswith("|") and len(cells_want) == len(cells_have):
            header = render.split_row(expected.splitlines()[0])
            for column, (a, b) in enumerate(zip(cells_want, cells_have)):
                if a != b:
                    lines.append(f"{where}: column '{header[column]}' should read {a!r} "
                                 f"(from {' '.join(region.names)}), not {b!r}")
        else:
            lines.append(f"{where}: should read {want!r} (from {' '.join(region.names)}), not {have!r}")
    return lines


def test_marked_tables_equal_their_json():
    failures, regions = [], 0
    for path in DOCS:
        for region in render.marked_regions(path):
            regions += 1
            missing = [name for name in region.names if not (render.RESULTS / name).exists()]
            if missing:
                failures.append(f"{rel(path)}:{region.line + 1}: the table is rendered from {', '.join(missing)}, "
                                "which tests/perf/results/ lacks: commit the JSON or remove the marker")
                continue
            expected = render.render(region.names)
            if expected != region.text:
                failures += difference(rel(path), region, expected)
    assert regions, "no marked table found: the marker format changed?"
    assert not failures, "\n".join(failures + ["rewrite them with: python scripts/render_benchmarks.py"])


def test_every_committed_result_is_rendered():
    marked = {name for path in DOCS for region in render.marked_regions(path) for name in region.names}
    committed = {path.name for path in tracked_files("tests/perf/results/*.json")}
    unrendered = sorted(committed - marked - set(AWAITING_MARKER))
    assert not unrendered, (f"tests/perf/results/{{{', '.join(unrendered)}}} is committed but no doc marks a table "
                            "with it: add <!-- results: NAME.json --> ... <!-- /results --> around the table it "
                            "fills (or list it in AWAITING_MARKER with the reason)")
    for name in marked | set(AWAITING_MARKER):
        render.renderer_for([name])  # every name has its renderer


def test_render_rewrites_only_marked_tables(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "memory_model_hf.json").write_text(json.dumps({"results": [
        {"row": "hf-3-fp32-adam", "rank": r, "shares": [0.75, 0.25], "measured": 300 * 2**20,
         "predicted": 200 * 2**20, "ratio": 1.5} for r in (0, 1)]}))
    doc = tmp_path / "doc.md"
    doc.write_text("intro\n\n<!-- results: memory_model_hf.json -->\n| old |\n| --- |\n| 1 |\n<!-- /results -->\n\n"
                   "| kept | by hand |\n| --- | --- |\n| 1 | 2 |\n\n<!-- results: zero3_capacity.json -->\n| x |\n"
                   "<!-- /results -->\n")
    text, report = render.rewrite(doc, results)
    assert [status for _, status in report] == ["rewritten", "JSON missing: left as it is"]
    assert "| `hf-3-fp32-adam` (ZeRO-3, re-cut by the engine) | (0.75, 0.25) | 300 / 200 MiB, 1.50 | " \
           "300 / 200 MiB, 1.50 |" in text
    assert "| kept | by hand |\n| --- | --- |\n| 1 | 2 |" in text and "| x |\n<!-- /results -->" in text
    doc.write_text("<!-- results: memory_model_hf.json -->\n| a |\n")
    with pytest.raises(ValueError, match="has no '<!-- /results -->'"):
        render.marked_regions(doc)
    with pytest.raises(ValueError, match="no renderer for nothing.json"):
        render.renderer_for(["nothing.json"])


# ---- configuration.md against blocks.py ----------------------------------------------------


BLOCK, REQUIRED = "a block (see below)", "required"


def code_default(field):
    if field.is_required():
        return REQUIRED
    if field.default_factory is not None and sub_model(field.annotation):
        return BLOCK
    return field.default


def doc_default(cell):
    """The default a configuration.md cell gives: the JSON in its first backticks, 'see below', 'required'."""
    if cell.startswith("see below"):
        return BLOCK
    if cell == "required":
        return REQUIRED
    match = re.match(r"`([^`]+)`", cell)
    if not match:
        return f"(no value in backticks: {cell!r})"
    try:
        return json.loads(match.group(1))
    except ValueError:
        return match.group(1)


def shown(value):
    return value if value in (BLOCK, REQUIRED) else json.dumps(value)


def same_value(a, b):
    return a == b and type(a) is type(b) or (type(a) in (int, float) and type(b) in (int, float) and a == b
                                             and not isinstance(a, bool) and not isinstance(b, bool))


@dataclass
class DocRow:
    line: int
    key: str
    default: str
    text: str


def configuration_rows():
    """``{section path: [DocRow]}`` for each configuration.md section headed by one backticked path."""
    lines = CONFIGURATION.read_text().splitlines()
    sections = {}
    for table in render.tables(lines):
        heading = re.fullmatch(r"`([\w.]+)`", table.section or "")
        if not heading or table.header[:2] != ["key", "default"]:
            continue
        for offset, cells in enumerate(table.rows):
            key = re.fullmatch(r"`([\w.]+)`", cells[0])
            sections.setdefault(heading.group(1), []).append(
                DocRow(table.line + 3 + offset, key.group(1) if key else cells[0], cells[1], " | ".join(cells)))
    return sections


def inline_default(row, name):
    """A sub-block key's default written inside its parent's row: in a JSON object in backticks,
    or as ``name`` (VALUE ...)."""
    for span in re.findall(r"`(\{[^`]*\})`", row.text):
        try:
            values = json.loads(span)
        except ValueError:
            continue
        if name in values:
            return values[name]
    match = re.search(rf"`{name}` \((`[^`]+`|[-\w.]+)", row.text)
    if not match:
        return f"(no default after `{name}`)"
    return doc_default(match.group(1) if match.group(1).startswith("`") else f"`{match.group(1)}`")


def test_configuration_lists_every_key_with_its_default():
    tree, sections = block_tree(), configuration_rows()
    failures = []
    documented = {}  # (block, key) -> DocRow
    for section, rows in sections.items():
        if section not in tree:
            continue  # fp16's and autotuning's keys: upstream's models
        for row in rows:
            block, _, key = f"{section}.{row.key}".rpartition(".")
            if block not in tree or key not in tree[block].model_fields:
                failures.append(f"docs/configuration.md:{row.line}: `{row.key}` is listed under `{section}`, but "
                                f"blocks.py's {tree.get(block, tree[section]).__name__} has no key '{key}'")
                continue
            documented[(block, key)] = row
    for block, model in tree.items():
        parent, _, name = block.rpartition(".")
        inline = documented.get((parent, name)) if not any(b == block for b, _ in documented) else None
        for key, field in model.model_fields.items():
            expected = code_default(field)
            row = documented.get((block, key))
            if row is not None:
                found = doc_default(row.default)
            elif inline is not None and (f"`{key}`" in inline.text or f'"{key}":' in inline.text):
                # A sub-block described in its parent's row: a required key only needs naming.
                row, found = inline, expected if expected == REQUIRED else inline_default(inline, key)
            else:
                failures.append(f"docs/configuration.md: `{block}.{key}` (blocks.py's {model.__name__}, default "
                                f"{shown(expected)}) is not listed")
                continue
            if not same_value(found, expected):
                failures.append(f"docs/configuration.md:{row.line}: `{block}.{key}` defaults to {shown(expected)} "
                                f"in blocks.py, the doc says {found!r}")
            for word in literal_words(field.annotation):
                if f'"{word}"' not in row.text:
                    failures.append(f"docs/configuration.md:{row.line}: `{block}.{key}` takes \"{word}\" "
                                    "(blocks.py), which its row does not name")
    assert not failures, "\n".join(failures)


def test_sub_block_lists_name_every_sub_block():
    """configuration.md's opening and blocks.py's docstring name heterogeneous_config's sub-blocks."""
    tree = block_tree()
    subs = sorted(path.split(".")[1] for path in tree if path.startswith("heterogeneous_config.")
                  and path.count(".") == 1)
    numbers = {3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine", 10: "ten"}
    opening = CONFIGURATION.read_text().split("\n\n")[1]
    match = re.search(r"with its (\w+) sub-blocks([^)]*)\)", opening)
    assert match, f"docs/configuration.md: the opening no longer says 'with its N sub-blocks ...': {opening!r}"
    assert (match.group(1), sorted(re.findall(r"`(\w+)`", match.group(2)))) == (numbers.get(len(subs)), subs), \
        f"docs/configuration.md:3: should read 'with its {numbers.get(len(subs))} sub-blocks' naming {subs}"
    docstring = ast.get_docstring(ast.parse((REPO / "deepspeed/runtime/heterogeneous/config/blocks.py").read_text()))
    match = re.search(r"sub-blocks ([\w,\s]+)\)", docstring)
    assert match and sorted(re.split(r",\s*", match.group(1))) == subs, \
        f"config/blocks.py:1: the docstring should name the sub-blocks {subs}"
