# SPDX-License-Identifier: Apache-2.0
"""Everything README.md, docs/*.md and the fork's docstrings name exists (pure, a few seconds).

Repository paths (``deepspeed/runtime/heterogeneous/...``, ``tests/perf/bench_overlap.py``, globs), paths
relative to a folder (``memory/pool.py``: some file of the assembled tree ends with it), patch
names (in patches/), module attributes (``cluster/agreement.check_settings_agree``: defined or
imported there), config keys (``heterogeneous_config.scheduler.check_interval``; in the docs also
from a sub-block, ``emulation.speeds``) and link targets with their anchors. Names of what a
command writes (ignored by git, or PRODUCTS) and placeholders (``DIR/profile.json``) pass.
"""

import ast
import fnmatch
import os
import re
from pathlib import Path

import pytest

from doc_sources import DOCS, REPO, block_tree, rel, render, tracked_files


SKIPPED_DIRS = {".git", ".venv", "build", "dist", "__pycache__", ".pytest_cache", "device-bundle", "device-rehearsal",
                ".device-rehearsal-venv", ".hetero-run", "hetero_demo", "hetero_profile", "node_modules"}
TOP = {"deepspeed", "tests", "examples", "scripts", "docs", "patches", "op_builder", "csrc", "accelerator", "bin",
       ".ci", "benchmarks", "requirements"}
EXTENSIONS = ("py", "md", "patch", "sh", "json", "txt", "png", "cpp", "h", "cu", "yaml")
# Names of things a command writes, not repository files (the command that writes each).
PRODUCTS = {
    "deepspeed-hetero-*.patch": "make dist",
    "autotuning_results/": "deepspeed --autotuning (the tuner's results folder)",
    "autotuning_exps/": "deepspeed --autotuning",
}


class Tree:
    """The files and folders of the assembled tree (the fork's and upstream's), relative, posix."""

    def __init__(self):
        self.files, self.dirs = set(), set()
        for folder, dirs, files in os.walk(REPO):
            dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS and not d.endswith(".egg-info")]
            base = Path(folder).relative_to(REPO).as_posix()
            base = "" if base == "." else base + "/"
            self.dirs.update(base + d for d in dirs)
            self.files.update(base + f for f in files)
        ignore = (REPO / ".gitignore").read_text().splitlines()
        self.ignored = [line.strip().strip("/") for line in ignore if line.strip() and not line.startswith(("#", "!"))]

    def find(self, name, folder=False):
        """Paths of the tree that are ``name`` or end with ``/name``."""
        pool = self.dirs if folder else self.files
        if "*" in name:
            return [p for p in pool if fnmatch.fnmatch(p, name) or fnmatch.fnmatch(p, "*/" + name)]
        return [p for p in pool if p == name or p.endswith("/" + name)]

    def generated(self, name):
        """A name git ignores (what a command writes), or a product of PRODUCTS."""
        first = name.strip("/").split("/")[0]
        return (any(fnmatch.fnmatch(name.strip("/"), pattern) or fnmatch.fnmatch(first, pattern)
                    for pattern in self.ignored if "*" not in pattern or "/" in pattern)
                or any(fnmatch.fnmatch(name, pattern) or name.startswith(pattern) for pattern in PRODUCTS))


PATH_CHARS = re.compile(r"[\w.*+/-]+")
MODULE_ATTRIBUTE = re.compile(r"((?:[\w]+/)+\w+)\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")


def path_problem(token, tree):
    """None when ``token`` names something that exists (or is not a path at all), else why not."""
    token = token.rstrip(".,:;)")
    if not PATH_CHARS.fullmatch(token) or not re.match(r"[A-Za-z_.]", token):
        return None  # /dev/shm, ~/.cache, 1/gas: not in the repository
    parts = token.rstrip("/").split("/")
    if any(re.fullmatch(r"[A-Z_]{2,}", part.split(".")[0]) for part in parts):
        return None  # DIR/profile.json, patches/NAME.patch: placeholders
    if token.startswith(("tests/perf/results/", "results/")):
        return None  # a benchmark's output: committed where a doc renders from it
    ext = parts[-1].rsplit(".", 1)[-1] if "." in parts[-1] else ""
    module = MODULE_ATTRIBUTE.fullmatch(token)
    if module and ext not in EXTENSIONS:
        return attribute_problem(module.group(1) + ".py", module.group(2).split("."), tree)
    folder = token.endswith("/")
    if not (folder or (ext in EXTENSIONS and ("/" in token or ext in ("py", "patch", "md", "sh")))
            or (parts[0] in TOP and len(parts) > 1)):
        return None  # '1/gas', 'ZeRO-1/2', 'and/or', profile.json: not a repository path
    if tree.generated(token) or (ext == "patch" and tree.generated("patches/" + token)):
        return None
    if ext == "patch" and "/" not in token:
        return None if (REPO / "patches" / token).exists() else f"no patches/{token}"
    if folder:
        return None if tree.find(token.rstrip("/"), folder=True) else "no such folder"
    return None if tree.find(token) or (parts[0] in TOP and tree.find(token, folder=True)) else "no such file"


def attribute_problem(module, attributes, tree):
    """None when ``module`` (a path relative to some folder) defines or imports each attribute."""
    files = tree.find(module)
    if not files:
        return f"no module {module}"
    for attribute in attributes:
        # Defined there (def, class, assignment), or imported into it (a documented re-export).
        pattern = re.compile(rf"^\s*(?:def|class)\s+{attribute}\b|^\s*{attribute}\s*[:=]|"
                             rf"^(?:from|import)\s[^#\n]*\b{attribute}\b|^\s+[\w, ]*\b{attribute}\b[\w, ]*\)?$", re.M)
        if not any(pattern.search((REPO / f).read_text(errors="replace")) for f in files):
            return f"{module} defines no {attribute}"
    return None


DOC_PATH = re.compile(r"(?<![\w/.-])((?:%s)/[\w.*+/-]+)" % "|".join(re.escape(t) for t in sorted(TOP)))
DOCSTRING_PATH = re.compile(r"(?<![\w/.*-])((?:[\w.*-]+/)+[\w.*-]*|[\w-]+\.(?:py|patch|md|sh))(?![\w/])")


@pytest.fixture(scope="module")
def tree():
    return Tree()


def doc_names(text):
    """``[(line, token)]``: backticked spans without spaces, and repository paths in the prose."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        spans = re.findall(r"`([^`\s]+)`", line)
        found += [(number, span) for span in spans]
        unquoted = re.sub(r"`[^`]*`", " ", line)
        found += [(number, m.group(1)) for m in DOC_PATH.finditer(unquoted)]
    return found


def test_docs_name_existing_paths(tree):
    failures = []
    for path in DOCS:
        for line, token in doc_names(path.read_text()):
            problem = path_problem(token, tree)
            if problem:
                failures.append(f"{rel(path)}:{line}: `{token}`: {problem}")
    assert not failures, "\n".join(failures)


def docstrings(path):
    """``[(line, text)]``: the docstrings of a module (and attribute docstrings: bare strings)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            found.append((node.lineno, node.value.value))
    return found


def test_docstrings_name_existing_paths(tree):
    failures = []
    for path in tracked_files("deepspeed/*.py", "op_builder/*.py", "scripts/*.py", "examples/*.py", "tests/*.py"):
        for line, text in docstrings(path):
            unquoted = re.sub(r"`+[^`]*`+", " ", text)
            tokens = set(re.findall(r"`+([^`\s]+)`+", text)) | {m.group(1) for m in DOCSTRING_PATH.finditer(unquoted)}
            for token in tokens:
                problem = path_problem(token, tree)
                if problem:
                    failures.append(f"{rel(path)}:{line}: docstring names '{token}': {problem}")
    assert not failures, "\n".join(sorted(set(failures)))


def slug(heading):
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(path):
    slugs, counts = set(), {}
    fenced = False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        match = render.HEADING.match(line)
        if match and not fenced:
            base = slug(match.group(2))
            slugs.add(base if base not in counts else f"{base}-{counts[base]}")
            counts[base] = counts.get(base, 0) + 1
    return slugs


def test_doc_links_reach_files_and_headings():
    failures = []
    for path in DOCS:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for target in re.findall(r"\]\(([^)\s]+)\)", line):
                if re.match(r"[a-z]+:", target):
                    continue
                file_part, _, anchor = target.partition("#")
                linked = (path.parent / file_part).resolve() if file_part else path
                if not linked.exists():
                    failures.append(f"{rel(path)}:{number}: link to {target}: no such file")
                elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                    failures.append(f"{rel(path)}:{number}: link to {target}: {rel(linked)} has no heading "
                                    f"#{anchor}")
    assert not failures, "\n".join(failures)


KEY_ROOTS = {"heterogeneous_config": "heterogeneous_config", "heterogeneous_memory": "heterogeneous_memory",
             "heterogeneous_offload": "zero_optimization.heterogeneous_offload",
             "zero_optimization.heterogeneous_offload": "zero_optimization.heterogeneous_offload"}
# Sub-block names that mean only the fork's sub-block when they start a dotted key (pipeline. and
# checkpoint. also name upstream's blocks and modules, so they are checked only in full).
SUB_BLOCKS = ("scheduler", "emulation", "communication", "low_communication")


def key_problem(key, tree, short_forms=True):
    """None when a dotted config key (``heterogeneous_config.scheduler.check_interval``) exists.
    ``short_forms``: also check keys that start at a sub-block (``emulation.speeds``)."""
    name = re.split(r"[:= \[]", key.strip(), maxsplit=1)[0]
    for prefix, block in sorted(KEY_ROOTS.items(), key=lambda item: -len(item[0])):
        if name.startswith(prefix + "."):
            parts, path = name[len(prefix) + 1:].split("."), block
            break
    else:
        first = name.split(".")[0]
        if not short_forms or first not in SUB_BLOCKS or name.endswith(".py"):
            return None
        paths = [p for p in tree if p.endswith("." + first)]
        parts, path = name.split(".")[1:], paths[0] if paths else None
    for part in parts:
        if path in tree and part in tree[path].model_fields:
            child = f"{path}.{part}"
            if child in tree:
                path = child
                continue
            return None
        if path in tree and f"{path}.{part}" in tree:
            path = f"{path}.{part}"
            continue
        return f"blocks.py has no key {path}.{part}"
    return None


def test_named_config_keys_exist():
    tree = block_tree()
    failures = []
    for path in DOCS:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for span in re.findall(r"`([^`]+)`", line):
                problem = key_problem(span, tree)
                if problem:
                    failures.append(f"{rel(path)}:{number}: `{span}`: {problem}")
    for path in tracked_files("deepspeed/*.py"):
        for number, text in docstrings(path):
            # Docstrings name the fork's modules too (emulation.Emulator): full key paths only.
            for span in re.findall(r"`+([^`\s]+)`+", text):
                problem = key_problem(span, tree, short_forms=False)
                if problem:
                    failures.append(f"{rel(path)}:{number}: docstring names `{span}`: {problem}")
    assert not failures, "\n".join(failures)


def test_path_and_key_checks_tell_names_apart(tree):
    """The checks above fail on what is missing and pass what exists or is no path at all."""
    for name in ("memory/pool.py", "comm/", "tests/perf/bench_*.py", "cluster/agreement.check_settings_agree",
                 "fp16-zero0-loss-scaling.patch", "1/gas", "ZeRO-1/2", "dist/*.patch", "DIR/profile.json",
                 "tests/perf/results/anything.json", "examples/configs/seed.json"):
        assert path_problem(name, tree) is None, name
    for name, problem in (("memory/nothing.py", "no such file"), ("zero-init-coordinate.patch", "no patches/"),
                          ("cluster/agreement.nothing_here", "defines no nothing_here"), ("nothing/", "no such folder"),
                          ("deepspeed/runtime/heterogeneous/nothing/", "no such folder"),
                          ("tests/perf/bench_nothing.py", "no such file")):
        assert problem in (path_problem(name, tree) or ""), name
    blocks = block_tree()
    for key in ("heterogeneous_config.scheduler.check_interval", "emulation.memory_gb", "emulation.speeds[r]",
                "heterogeneous_offload.nvme_offload", "communication.mode: \"low_communication\"",
                "pipeline.num_stages", "heterogeneous_config.elastic.checkpoint.every_steps"):
        assert key_problem(key, blocks) is None, key
    for key in ("heterogeneous_config.profile_step", "scheduler.interval", "heterogeneous_memory.chunking"):
        assert "has no key" in (key_problem(key, blocks) or ""), key
