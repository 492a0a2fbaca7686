# SPDX-License-Identifier: Apache-2.0
"""The fork's package layout: subpackages by concern, in layers, without cycles.

Run alone: ``python -m pytest tests/unit/heterogeneous/test_layout.py``. It reads every module of
``deepspeed/runtime/heterogeneous`` with ``ast`` (imports inside functions count too) and checks:
- a subpackage imports only the subpackages listed before it in LAYERS;
- no subpackage imports a top-level module (state, startup, runtime, engine, checkpoint);
- the module graph has no cycle;
- importing ``deepspeed.comm`` loads nothing of the fork but the comm clock.
"""

import ast
import subprocess
import sys
from pathlib import Path

import deepspeed.runtime.heterogeneous as package

PKG = "deepspeed.runtime.heterogeneous"
ROOT = Path(package.__file__).parent
# Lowest first: each may import only those before it.
LAYERS = ["config", "measure", "cluster", "emulation", "memory", "planning", "data", "comm", "pipeline", "integrations",
          "control", "elastic", "forecast", "cli"]
# Top-level modules a subpackage may import: constants with no imports of their own.
LEAVES = {"version"}
# Thin re-exports of documented paths (they import downwards by construction).
SHIMS = {"hf_trainer", "process_exit"}


def module_name(path):
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([PKG] + parts)


def imports_of(path):
    """The fork modules ``path`` imports (absolute names), with the line of each."""
    name = module_name(path)
    package_parts = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[:len(package_parts) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith(PKG):
                continue
            for alias in node.names:  # "from . import x" may name a module
                candidate = f"{target}.{alias.name}"
                found.append((candidate if _is_module(candidate) else target, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.startswith(PKG)]
    return found


def _is_module(name):
    rel = Path(*name.split(".")[3:])
    return (ROOT / rel).with_suffix(".py").is_file() or (ROOT / rel / "__init__.py").is_file()


def _part(name):
    """The subpackage or top-level module a fork module belongs to."""
    rest = name[len(PKG) + 1:] if name != PKG else ""
    return rest.split(".")[0] if rest else ""


def graph():
    return {module_name(p): imports_of(p) for p in sorted(ROOT.rglob("*.py"))}


def test_subpackages_import_only_lower_layers():
    assert sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()) == sorted(LAYERS)
    problems = []
    for module, targets in graph().items():
        source = _part(module)
        if source not in LAYERS:
            continue
        for target, line in targets:
            dest = _part(target)
            if dest == source or dest in LEAVES:
                continue
            if dest not in LAYERS:
                problems.append(f"{module}:{line} imports the top-level {target}")
            elif LAYERS.index(dest) > LAYERS.index(source):
                problems.append(f"{module}:{line} imports {target}, a higher layer ({dest} above {source})")
    assert not problems, "\n".join(problems)


def test_no_import_cycles():
    edges = {m: {t for t, _ in targets if t != m and t != PKG} for m, targets in graph().items()}
    # Package __init__ files are docstrings (the top one is lazy): an edge to a package is no cycle.
    state, stack, cycles = {}, [], []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_top_level_stays_small():
    top = sorted(p.stem for p in ROOT.glob("*.py"))
    assert len(top) <= 12, top
    assert SHIMS <= set(top)


def test_subpackage_inits_import_nothing():
    for name in LAYERS:
        tree = ast.parse((ROOT / name / "__init__.py").read_text())
        assert ast.get_docstring(tree), f"{name}/__init__.py says what it owns"
        assert not [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))], name


def _module_level_fork_imports(path):
    return [target for target, line in imports_of(path)
            if any(getattr(n, "lineno", None) == line for n in ast.parse(path.read_text()).body)]


def test_deepspeed_comm_loads_only_the_comm_clock():
    """Upstream's comm.py imports the comm clock: the package's __init__ (lazy) and the clock itself
    load nothing else of the fork, and a lazy public name still resolves."""
    assert _module_level_fork_imports(ROOT / "__init__.py") == []
    assert _module_level_fork_imports(ROOT / "measure" / "__init__.py") == []
    assert _module_level_fork_imports(ROOT / "measure" / "comm_clock.py") == []
    code = ("import sys, deepspeed.runtime.heterogeneous as h\n"
            "h.HeterogeneousMemoryPool\n"
            f"print('{PKG}.memory.pool' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == "True"


def test_the_config_reads_the_one_strategy_registry():
    """The registry sits in the config layer (which imports nothing above it); the built-in
    strategies live with the planner and are found by their module's name."""
    from deepspeed.runtime.heterogeneous.config import strategies
    from deepspeed.runtime.heterogeneous.config.settings import load_heterogeneous_settings
    from deepspeed.runtime.heterogeneous.planning import strategies as built_in
    assert strategies.BUILTIN_MODULE == built_in.__name__
    assert strategies.strategy_names() == ("compute_aware", "manual", "uniform")
    assert {strategies.get_strategy(n).__module__ for n in strategies.strategy_names()} == {built_in.__name__}
    config = load_heterogeneous_settings({"heterogeneous_config": {"enabled": True}}).config
    assert config.strategy is strategies.get_strategy("compute_aware") and config.strategy.adapts


def test_documented_paths_still_import():
    from deepspeed.runtime.heterogeneous import (HeterogeneousConfig, HeterogeneousMemoryPool,  # noqa: F401
                                                 ModelStateSpec, load_heterogeneous_settings)
    from deepspeed.runtime.heterogeneous.hf_trainer import HeterogeneousTrainer  # noqa: F401
    from deepspeed.runtime.heterogeneous.process_exit import end_process  # noqa: F401
    from deepspeed.profiling.heterogeneous_profiler import HeterogeneousProfiler  # noqa: F401
