"""patches/heterogeneous_comm_optimization.patch: the communication feature as one git-apply patch.

Users are promised the communication work as ``heterogeneous_comm_optimization.patch``, applied
to a pristine DeepSpeed with ``git apply`` and built with ``python setup.py build_ext --inplace``.
This module produces that file from the series (``make dist``) and verifies it (``make check``).

What "exactly the communication feature" means. The feature (hierarchical gradient reduction,
link-aware buckets, inter-host compression) is configured by ``heterogeneous_config.communication``,
measures its links as the config is coordinated (``coordinator.py``) and acts only when
``heterogeneous_config.enabled`` is true, which also gives every rank its own micro-batch, exact
only through the engine's loss weight. Its upstream hooks sit in ``engine.py`` and
``stage_1_and_2.py`` next to the fork's other hooks, whose lines are their context. So the patch
cannot be the two hook files alone: it is the smallest part of the fork in which the feature runs
as it does in the fork, found by two rules applied until nothing changes:

1. series patches: ``comm-hierarchical-reduction.patch``, the patch that creates the fork's state
   (``config-heterogeneous-blocks.patch``) and the env report's (so ``Communication Optimization``
   is reported), plus every patch earlier in the series that changes a file an included patch
   changes (its lines are the included patch's context);
2. the fork's own files: every fork module imported (at any depth, also inside functions) by the
   upstream files those patches change or by an included fork module, with its packages'
   ``__init__.py``.

Left out: the launcher's additions, the native op's build (the fork falls back to torch), the
fp16 adaptive loss scaler, the flops profiler, the autotuner and the memory work that these rules
do not reach. The patch's message lists what it holds.

Kept apart from ``patches/series``: the file is an output, never applied by ``make tree``, and
``patchset.check`` names it as such (``GENERATED_PATCHES``).
"""

import ast
import posixpath
import tempfile
from pathlib import Path

NAME = "heterogeneous_comm_optimization.patch"
FEATURE_PATCH = "comm-hierarchical-reduction.patch"
BASE_PATCHES = ("config-heterogeneous-blocks.patch", "env-report-heterogeneous.patch")


def patches_needed(metas, seeds=(FEATURE_PATCH, ) + BASE_PATCHES):
    """The series patches (in series order) the feature needs: ``seeds`` (the patches it starts
    from) and, transitively, every earlier patch that changes a file an included patch changes."""
    names = list(metas)
    missing = [name for name in seeds if name not in metas]
    if missing:
        raise ValueError(f"patches/series lacks {', '.join(missing)}, which the communication patch is built from")
    included = set(seeds)
    changed = True
    while changed:
        changed = False
        for name in list(included):
            for earlier in names[:names.index(name)]:
                if earlier not in included and metas[earlier].owned & metas[name].owned:
                    included.add(earlier)
                    changed = True
    return [name for name in names if name in included]


def module_paths(module):
    """Candidate files of a dotted module name: the module, or its package."""
    base = module.replace(".", "/")
    return (base + ".py", base + "/__init__.py")


def imported_modules(source, path):
    """Dotted names of everything ``source`` (the file at ``path``) imports, relative imports
    resolved; ``from a import b`` yields both ``a`` and ``a.b`` (b may be a module)."""
    package = posixpath.dirname(path).replace("/", ".")  # a module's and a package's __init__ alike
    found = []
    for node in ast.walk(ast.parse(source, filename=path)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - (node.level - 1)] if node.level > 1 else parts
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found.append(base)
            found += [f"{base}.{alias.name}" for alias in node.names if alias.name != "*"]
    return found


def fork_files_needed(start_files, tree, fork_paths):
    """The fork's own files (``fork_paths``) reached by importing from ``start_files`` (paths in
    ``tree``, {path: (bytes, mode)}), with the ``__init__.py`` of each package on the way."""
    needed, queue, seen = set(), list(start_files), set()
    while queue:
        path = queue.pop()
        if path in seen or not path.endswith(".py") or path not in tree:
            continue
        seen.add(path)
        for module in imported_modules(tree[path][0].decode(), path):
            for candidate in module_paths(module):
                if candidate in tree:
                    parts = candidate.split("/")
                    for depth in range(1, len(parts)):
                        init = "/".join(parts[:depth]) + "/__init__.py"
                        if init in fork_paths and init not in needed:
                            needed.add(init)
                            queue.append(init)
                    if candidate in fork_paths and candidate not in needed:
                        needed.add(candidate)
                    queue.append(candidate)
    return needed


def message(patches, fork_files, version):
    listed = "\n".join(f"  {name}" for name in patches)
    modules = "\n".join(f"  {path}" for path in sorted(fork_files))
    return (f"deepspeed-hetero: heterogeneous communication optimization on DeepSpeed {version}\n\n"
            "Hierarchical gradient reduction across hosts (inside each host, shards between hosts,\n"
            "inside again; uneven hosts through leaders), ZeRO bucket sizes from the slowest measured\n"
            "inter-host link, optional bf16/fp16 compression of the inter-host step, configured by\n"
            "heterogeneous_config.communication and on by default (auto) when heterogeneous_config.enabled\n"
            "and the ranks span more than one host.\n\n"
            "The feature rests on the fork's runtime: its settings are a block of heterogeneous_config,\n"
            "its links are measured where the fork builds its state, and enabling the fork also plans\n"
            "per-rank micro-batches, exact only through the engine's loss weight. So this patch holds the\n"
            "smallest part of the fork in which the feature runs as in the fork (scripts/comm_patch.py):\n"
            "the hierarchical-reduction patch, the state and env-report patches, every series patch whose\n"
            "lines are their context, and the fork modules they import. Not included: the launcher's\n"
            "additions, the native op build (torch fallbacks apply), and what nothing here imports.\n\n"
            f"Series patches applied:\n{listed}\n\nFork modules added:\n{modules}\n\n"
            "Apply to a pristine DeepSpeed with 'git apply', then 'python setup.py build_ext --inplace'.\n")


def comm_patch(patchset, pin, pristine):
    """(name, text) of the communication patch, rendered from the series and the fork's files."""
    metas = patchset.load_series_meta()
    patches = patches_needed(metas)
    fork = patchset.fork_tree()
    with tempfile.TemporaryDirectory() as tmp:
        patchset.write_tree(pristine, tmp)
        touched = set()
        for name in patches:
            patchset.git_apply(patchset.PATCH_DIR / name, tmp, f"patches/{name}")
            touched |= metas[name].owned
        upstream_after = patchset.read_tree(tmp, sorted(touched))
    tree = dict(pristine)
    tree.update(upstream_after)
    fork_py = {path: value for path, value in fork.items() if value[1] != 0o120000}
    tree_with_fork = dict(tree)
    tree_with_fork.update(fork_py)
    fork_files = fork_files_needed(sorted(touched), tree_with_fork, set(fork_py) - set(pristine))
    after = dict(tree)
    after.update({path: fork_py[path] for path in fork_files})
    text = patchset.format_patch(pristine, after, message(patches, fork_files, pin["version"]))
    return NAME, text, after


def write(patchset, pin, pristine):
    """``make dist``: write patches/NAME. Returns its path and line count."""
    name, text, _ = comm_patch(patchset, pin, pristine)
    path = patchset.PATCH_DIR / name
    path.write_text(text)
    return path, len(text.splitlines())


def problems(patchset, pin, pristine):
    """``make check``: the patch, rendered now, turns pristine upstream into exactly the tree it was
    rendered from; a file ``make dist`` left in patches/ must be that patch (a fresh checkout
    without one passes: the file is an output)."""
    name, text, after = comm_patch(patchset, pin, pristine)
    path = patchset.PATCH_DIR / name
    found = []
    if path.is_file() and path.read_text() != text:
        found.append(f"patches/{name} is out of date with the series and the fork's modules; run 'make dist'")
    try:
        found += patchset.diff_trees(after, patchset.apply_to_pristine(pristine, text), f"patches/{name}")
    except patchset.PatchSetError as exc:
        found.append(f"patches/{name}: {exc}")
    return found


def is_generated(path):
    return Path(path).name == NAME
