# SPDX-License-Identifier: Apache-2.0
"""The README's examples run as written, and the README shows exactly the files under examples/.

A fenced block in README.md preceded by a line ``<!-- example: examples/... -->`` must equal that
file (less the file's SPDX line); unmarked blocks are not checked. Each example file runs here:
``examples/configs/seed.json`` under the real ``deepspeed`` launcher, the Python snippets on 2 ranks
in one spawned group, ``env_report.sh`` as a shell script, and ``train.py`` as a plain ``python``
process with no launcher variables (no mpi4py needed).
"""

import json
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from harness import REPO_ROOT, fork_environment, launch_deepspeed, run_subcases

EXAMPLES = REPO_ROOT / "examples"
MARKER = re.compile(r"^<!-- example: (?P<path>\S+) -->\s*$")
LICENSE_LINE = "# SPDX-License-Identifier:"
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")


def marked_blocks(text):
    """``[(path, block text, README line)]`` for each fenced block right after an example marker."""
    lines = text.splitlines()
    blocks = []
    for index, line in enumerate(lines):
        match = MARKER.match(line)
        if not match:
            continue
        fence = lines[index + 1] if index + 1 < len(lines) else ""
        assert fence.lstrip().startswith("```"), (f"README.md:{index + 1}: an example marker must be followed "
                                                  f"directly by a fenced block, found {fence!r}")
        indent = fence[:len(fence) - len(fence.lstrip())]
        body = []
        for inner in lines[index + 2:]:
            if inner.strip() == "```":
                break
            body.append(inner[len(indent):] if inner.startswith(indent) else inner)
        else:
            raise AssertionError(f"README.md:{index + 2}: fenced block never closed")
        blocks.append((match["path"], "\n".join(body), index + 1))
    return blocks


def shown_text(path):
    """What the README shows of an example file: the file less its license line."""
    lines = (REPO_ROOT / path).read_text().splitlines()
    if lines and lines[0].startswith(LICENSE_LINE):
        lines = lines[1:]
    return "\n".join(lines).strip("\n")


def test_marker_parsing():
    text = ("intro\n<!-- example: examples/a.json -->\n```json\n{\"a\": 1}\n```\n```python\nunmarked\n```\n"
            "  <!-- example: examples/b.sh -->\n  ```bash\n  echo hi\n  ```\n")
    assert marked_blocks(text) == [("examples/a.json", '{"a": 1}', 2)]
    # An indented block (inside a list item) is compared without its indentation.
    text = "<!-- example: examples/b.sh -->\n  ```bash\n  echo hi\n  ```\n"
    assert marked_blocks(text) == [("examples/b.sh", "echo hi", 1)]


def test_readme_blocks_equal_the_example_files():
    blocks = marked_blocks((REPO_ROOT / "README.md").read_text())
    for path, block, line in blocks:
        assert (REPO_ROOT / path).is_file(), f"README.md:{line}: marker names {path}, which does not exist"
        assert block.strip("\n") == shown_text(path), (
            f"README.md:{line}: the block differs from {path}; copy the file into the README (or the README "
            f"into the file)")


def test_example_configs_parse_as_the_fork_and_the_tuner_read_them():
    """Every example config (examples/**/*.json): valid JSON, the fork's blocks load for the ranks
    its emulation lists, and an autotuning block parses into settings and a tuning space (the
    README's autotuning command itself takes minutes; its config is checked here)."""
    from deepspeed.autotuning.heterogeneous.settings import parse_settings
    from deepspeed.autotuning.heterogeneous.space import parse_space
    from deepspeed.runtime.heterogeneous.config.settings import load_heterogeneous_settings

    paths = sorted(EXAMPLES.rglob("*.json"))
    assert {"seed.json", "ds_config.json"} <= {p.name for p in paths}, paths
    for path in paths:
        config = json.loads(path.read_text())
        emulation = (config.get("heterogeneous_config") or {}).get("emulation") or {}
        world = len(emulation.get("speeds") or emulation.get("memory_gb") or [0, 0])
        load_heterogeneous_settings(config, world_size=world)
        if "autotuning" in config:  # a wrong key or value raises AutotuningConfigError, naming it
            parse_space(config, parse_settings(config), world)


def _with_examples(tmp_path):
    # Snippets name files relative to the repository root and write their outputs to the working
    # directory: run them in a scratch directory that sees examples/ through a link.
    (tmp_path / "examples").symlink_to(EXAMPLES)
    return tmp_path


def _run_snippet(rank, world_size, script, cwd):
    os.chdir(cwd)
    sys.argv = [script]
    namespace = runpy.run_path(str(REPO_ROOT / script), run_name="__main__")
    engine = namespace["engine"]
    return {"plan": list(engine.heterogeneous_plan.micro_batch_sizes),
            "train_batch_size": engine.train_batch_size(),
            "last_batch": len(namespace["inputs"])}


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_python_snippets_on_two_ranks(tmp_path):
    cwd = _with_examples(tmp_path)
    scripts = ["examples/snippets/config_params.py", "examples/snippets/sampler.py", "examples/snippets/profiler.py"]
    results = run_subcases(_run_snippet, [{"script": s, "cwd": str(cwd)} for s in scripts], timeout=200)
    by_script = dict(zip(scripts, results))
    for script, ranks in by_script.items():
        assert ranks[0]["plan"] == ranks[1]["plan"], script
        assert sum(ranks[0]["plan"]) == ranks[0]["train_batch_size"], script
    # The sampler feeds each rank its manual share.
    assert [r["last_batch"] for r in by_script["examples/snippets/sampler.py"]] == [20, 12]
    # The profiler's outputs go to the folder the snippet names, under the working directory.
    profile = json.loads((cwd / "hetero_profile" / "profile.json").read_text())
    assert profile, "the profiler wrote an empty JSON"
    assert (cwd / "hetero_profile" / "timeline.png").stat().st_size > 0


def test_timeline_recipe_shows_a_slow_down_and_a_rebalance_within_its_profile():
    """docs/profiler.md's timeline recipe (2 minutes; run by hand for the PNG there): it names files
    that exist, and its config slows a rank and rebalances within the steps it profiles."""
    from examples.train_heterogeneous import MEASURE_FROM

    words = shown_text("examples/snippets/timeline.sh").replace("\\\n", " ").split()
    assert words[:2] == ["deepspeed", "--num_gpus"] and (REPO_ROOT / words[3]).is_file(), words
    options = dict(zip(words[4::2], words[5::2]))
    config = json.loads((REPO_ROOT / options["--deepspeed_config"]).read_text())["heterogeneous_config"]
    steps = int(options["--steps"])
    (change, ) = config["emulation"]["speed_schedule"]
    assert MEASURE_FROM + 1 < change["step"] < steps and min(change["speeds"]) < 1, change
    assert config["scheduler"]["dynamic_rebalancing"]
    assert change["step"] + 2 * config["scheduler"]["check_interval"] < steps  # two checks see the slow-down
    assert options["--profile"] == "hetero_profile"


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_seed_config_under_the_deepspeed_launcher():
    code, output = launch_deepspeed(EXAMPLES / "snippets" / "train.py",
                                    ["--deepspeed_config", EXAMPLES / "configs" / "seed.json", "--steps", "4"],
                                    timeout=200, cwd=REPO_ROOT)
    assert code == 0, output[-6000:]
    steps = [line for line in output.splitlines() if line.startswith("step ")]
    assert len(steps) == 4, output[-6000:]
    # mixed_precision_support "adaptive" picks bf16 on the CPU accelerator; the script follows it.
    assert "dtype torch.bfloat16" in steps[-1]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_pipeline_snippet_under_the_deepspeed_launcher():
    code, output = launch_deepspeed(EXAMPLES / "snippets" / "pipeline.py", timeout=200, cwd=REPO_ROOT)
    assert code == 0, output[-6000:]
    assert "[deepspeed-hetero] pipeline: 2 stage(s) x 1 replica(s)" in output, output[-6000:]
    held = sorted(re.findall(r"stage (\d) holds layers (\d+)-(\d+)", output))
    assert [stage for stage, _, _ in held] == ["0", "1"], output[-6000:]
    assert held[0][1] == "0" and int(held[1][1]) == int(held[0][2]) + 1 and held[1][2] == "11", held


def clean_environment():
    """This process's environment without any launcher's variables, as for ``python train.py``."""
    variables = {k: v for k, v in os.environ.items()
                 if k not in LAUNCHER_VARIABLES and not k.startswith(("OMPI_", "PMI", "SLURM_", "DS_HETEROGENEOUS"))}
    variables.update(fork_environment(), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    return variables


@pytest.mark.timeout(120)
def test_plain_python_without_a_launcher_runs_as_one_process():
    proc = subprocess.run([sys.executable, "examples/snippets/train.py", "--deepspeed_config",
                           "examples/configs/seed.json", "--steps", "2"],
                          cwd=REPO_ROOT, env=clean_environment(), capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "mpi4py" not in proc.stderr
    assert "micro-batches [128]" in proc.stdout   # one rank carries the whole micro-step


@pytest.mark.timeout(120)
def test_env_report_snippet(tmp_path):
    cwd = _with_examples(tmp_path)
    env = clean_environment()
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.run(["bash", "-e", str(EXAMPLES / "snippets" / "env_report.sh")], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert proc.stdout.count("Heterogeneous Environment: ") == 2
    assert "Heterogeneous Environment: Enabled" in proc.stdout
