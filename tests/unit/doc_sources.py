# SPDX-License-Identifier: Apache-2.0
"""What the docs tests read: the docs, the render script, the fork's files and its config blocks.

Shared by test_docs.py (tables and configuration), test_doc_names.py (paths, keys, anchors) and
test_doc_figures.py (figures quoted twice).
"""

import importlib.util
import subprocess
import typing
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
BENCHMARKS = REPO / "docs" / "benchmarks.md"
CONFIGURATION = REPO / "docs" / "configuration.md"


def _load_renderer():
    """scripts/render_benchmarks.py as a module (scripts/ is no package)."""
    spec = importlib.util.spec_from_file_location("render_benchmarks", REPO / "scripts" / "render_benchmarks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = _load_renderer()
DOCS = render.doc_paths(REPO)


def rel(path):
    return Path(path).relative_to(REPO).as_posix()


def tracked_files(*patterns):
    """The fork's own files (git ls-files), or a skip where this is no git checkout."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--", *patterns], cwd=REPO, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the fork's own files are unknown")
    return [REPO / name for name in out.stdout.decode().split("\0") if name]


def blocks_module():
    from deepspeed.runtime.heterogeneous.config import blocks
    return blocks


def sub_model(annotation):
    """The config model inside a field's annotation (Optional[...], Annotated[...]), or None."""
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel
    if isinstance(annotation, type) and issubclass(annotation, DeepSpeedConfigModel):
        return annotation
    for argument in typing.get_args(annotation):
        found = sub_model(argument)
        if found:
            return found
    return None


def literal_words(annotation):
    """The string values of every Literal inside an annotation."""
    if typing.get_origin(annotation) is typing.Literal:
        return [value for value in typing.get_args(annotation) if isinstance(value, str)]
    return [word for argument in typing.get_args(annotation) for word in literal_words(argument)]


def block_tree():
    """``{block path: model}`` for the fork's three blocks and every sub-block under them."""
    blocks = blocks_module()
    tree = {}

    def walk(path, model):
        tree[path] = model
        for name, field in model.model_fields.items():
            child = sub_model(field.annotation)
            if child:
                walk(f"{path}.{name}", child)

    walk("heterogeneous_config", blocks.HeterogeneousConfig)
    walk("heterogeneous_memory", blocks.HeterogeneousMemoryConfig)
    walk("zero_optimization.heterogeneous_offload", blocks.HeterogeneousOffloadConfig)
    return tree
