# deepspeed-hetero: a patch set on pinned upstream DeepSpeed (see UPSTREAM and README.md).
# Every target that needs Python sets up .venv itself, so a fresh clone needs only
# python3 (>= 3.10, with venv; torch 2.13.0 has no wheel for older), git and a C++ compiler.

PYTHON      ?= python3
VENV        ?= .venv
PY          := $(VENV)/bin/python
PIP         := $(PY) -m pip --disable-pip-version-check
TORCH_SPEC  ?= torch==2.13.0
# Where the torch install looks (torch alone; everything else comes from PyPI). PyPI's Linux torch
# is the CUDA build and pulls ~28 NVIDIA packages, so the default is PyTorch's CPU index; with
# local wheels (PIP_FIND_LINKS) pip's own configuration decides. A GPU user passes a CUDA index
# (TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126), or TORCH_INDEX_URL= for pip's default.
ifdef PIP_FIND_LINKS
TORCH_INDEX_URL ?=
else
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu
endif
PYTEST_ARGS ?=
# The patch-set tool needs only python3, git and pip: no venv, so 'make check' works anywhere.
PATCHSET    := $(PYTHON) scripts/patchset.py

# ninja (a dependency installed into the venv) must be on PATH for JIT op builds.
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: help venv tree install export check dist test test-quick test-all demo multihost-demo perf clean device-bundle device-rehearsal

help:
	@echo "make demo     set up, assemble, install and run the heterogeneous-training demo"
	@echo "make multihost-demo  the same on two emulated hosts (root: network namespaces, tc)"
	@echo "make test     set up, assemble, install and run the test suite"
	@echo "make test-quick  the same set-up, then the pure and single-process tests only (a few minutes)"
	@echo "make tree     fetch the pinned upstream sdist and apply patches/series in place"
	@echo "make export   regenerate patches/*.patch from edited upstream files"
	@echo "make check    verify series, tree, exports and packages"
	@echo "make dist     write dist/*.tar.gz (full tree) and dist/*.patch (combined git-apply patch)"
	@echo "make device-bundle     write device-bundle/: the fork's wheel + the wheels the GPU image lacks"
	@echo "make device-rehearsal  run scripts/device_check.sh from the bundle here, without a GPU (downloads torch)"

$(VENV)/.torch:
	@# torch 2.13.0 requires Python >= 3.10: say so here rather than let pip fail on it later.
	@$(PYTHON) -c 'import sys; sys.exit(None if sys.version_info >= (3, 10) else "deepspeed-hetero needs Python >= 3.10 (torch 2.13.0 requires it); $(PYTHON) is " + sys.version.split()[0] + ": run make with PYTHON=python3.10 or newer")'
	$(PYTHON) -m venv $(VENV)
	@# torch first and pinned: an unpinned dependency would pull a multi-GB CUDA build.
	$(PIP) install -q "$(TORCH_SPEC)"$(if $(TORCH_INDEX_URL), --index-url "$(TORCH_INDEX_URL)")
	$(PIP) install -q pytest pytest-timeout matplotlib
	@touch $@

venv: $(VENV)/.torch

# What only the tests need: the Hugging Face Trainer integration (and PEFT LoRA on it) is tested with the real packages.
# The installed torch is pinned as a constraint so that nothing replaces it.
TEST_EXTRAS := transformers==5.24.0 accelerate==1.15.0 peft==0.21.2
$(VENV)/.test-extras: $(VENV)/.torch Makefile
	$(PY) -c 'import torch; print("torch==" + torch.__version__)' > $(VENV)/torch-constraint.txt
	$(PIP) install -q $(TEST_EXTRAS) -c $(VENV)/torch-constraint.txt
	@touch $@

tree:
	$(PATCHSET) tree

$(VENV)/.installed: $(VENV)/.torch setup.py UPSTREAM
	@# --no-build-isolation: the build must see the venv's CPU torch (the op builders need it).
	$(PIP) install -q --no-build-isolation -e . $(INSTALL_ARGS)
	@touch $@

# The sdist ships the op builders and their C++ sources twice (op_builder/ + csrc/, and
# deepspeed/ops/op_builder/ + deepspeed/ops/csrc/). The accelerator takes the top-level copy
# whenever 'op_builder' is importable, and JIT builds record absolute source paths, so a process
# that saw the other copy rebuilt shm_comm and fused_adam. This .pth puts the tree's root on
# every venv process's sys.path, whatever PYTHONPATH says: one copy of the op sources.
ROOT_PTH_CMD := import pathlib, sysconfig; \
	pathlib.Path(sysconfig.get_paths()["purelib"], "deepspeed_hetero_root.pth").write_text("$(CURDIR)\n")

install: venv tree
	@$(MAKE) --no-print-directory $(VENV)/.installed
	@$(PY) -c '$(ROOT_PTH_CMD)'

export:
	$(PATCHSET) export

check:
	$(PATCHSET) check

dist:
	$(PATCHSET) dist

test: install $(VENV)/.test-extras
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

test-quick: install $(VENV)/.test-extras
	@# The pure and single-process tests: no test that spawns ranks or runs the launcher.
	$(PY) -m pytest tests/unit -m "not multiprocess" $(PYTEST_ARGS)

demo: install
	$(PY) examples/heterogeneous_demo.py

multihost-demo: install
	@# Needs root, ip and tc: two emulated hosts (network namespaces, a 200 Mbit/s link), 2 ranks each.
	$(PY) scripts/emulated_cluster.py --ranks 2,2 --rate-mbit 200 -- examples/snippets/train.py \
		--deepspeed_config examples/configs/multihost.json --steps 8

perf: install
	@# Benchmarks print ratios measured side by side and write JSON to tests/perf/results/.
	@# One line per benchmark as it starts ("[3/24] bench_busy_neighbour.py, 412 s so far"), and the total at the end.
	@set -e; benches="$$(ls tests/perf/bench_*.py)"; total=$$(echo "$$benches" | wc -l); n=0; began=$$(date +%s); \
	for bench in $$benches; do \
		n=$$((n + 1)); echo "[$$n/$$total] $$(basename $$bench), $$(($$(date +%s) - began)) s so far"; \
		$(PY) $$bench; \
	done; echo "make perf: $$total benchmarks in $$(($$(date +%s) - began)) s"

# The GPU machine (docs/device-check.md): no network, its own python3 3.12 with torch 2.11, and only
# the working tree plus carried paths reach it. The bundle needs python3 with pip (and the index);
# the rehearsal sets up its own venv with torch 2.11.0 from the index (several GB: not in make test).
DEVICE_BUNDLE   ?= device-bundle
REHEARSAL_VENV  ?= .device-rehearsal-venv
device-bundle:
	$(PYTHON) scripts/device_bundle.py --out $(DEVICE_BUNDLE)

device-rehearsal: device-bundle
	$(PYTHON) scripts/device_rehearsal.py --bundle $(DEVICE_BUNDLE) --venv $(REHEARSAL_VENV) --out device-rehearsal

clean:
	rm -rf build dist .pytest_cache $(VENV)/.installed
