# deepspeed-hetero: a patch set on pinned upstream DeepSpeed (see UPSTREAM and README.md).
# Every target that needs Python sets up .venv itself, so a fresh clone needs only
# python3 (>= 3.9, with venv), git and a C++ compiler.

PYTHON      ?= python3
VENV        ?= .venv
PY          := $(VENV)/bin/python
PIP         := $(PY) -m pip --disable-pip-version-check
TORCH_SPEC  ?= torch==2.13.0
PYTEST_ARGS ?=
# The patch-set tool needs only python3, git and pip: no venv, so 'make check' works anywhere.
PATCHSET    := $(PYTHON) scripts/patchset.py

# ninja (a dependency installed into the venv) must be on PATH for JIT op builds; the tree's root
# on PYTHONPATH makes every process take op builders from the same copy of op_builder/, so JIT
# builds are not redone (see tests/conftest.py).
export PATH := $(abspath $(VENV))/bin:$(PATH)
RUN_ENV     := PYTHONPATH=$(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))

.PHONY: help venv tree install export check dist test test-all demo perf clean

help:
	@echo "make demo     set up, assemble, install and run the heterogeneous-training demo"
	@echo "make test     set up, assemble, install and run the test suite"
	@echo "make tree     fetch the pinned upstream sdist and apply patches/series in place"
	@echo "make export   regenerate patches/*.patch from edited upstream files"
	@echo "make check    verify series, tree, exports and packages"
	@echo "make dist     write dist/*.tar.gz (full tree) and dist/*.patch (combined git-apply patch)"

$(VENV)/.torch:
	$(PYTHON) -m venv $(VENV)
	@# torch first and pinned: an unpinned dependency would pull a multi-GB CUDA build.
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q pytest pytest-timeout matplotlib
	@touch $@

venv: $(VENV)/.torch

tree:
	$(PATCHSET) tree

$(VENV)/.installed: $(VENV)/.torch setup.py UPSTREAM
	@# --no-build-isolation: the build must see the venv's CPU torch (the op builders need it).
	$(PIP) install -q --no-build-isolation -e . $(INSTALL_ARGS)
	@touch $@

install: venv tree
	@$(MAKE) --no-print-directory $(VENV)/.installed

export:
	$(PATCHSET) export

check:
	$(PATCHSET) check

dist:
	$(PATCHSET) dist

test: install
	$(RUN_ENV) $(PY) -m pytest tests/unit $(PYTEST_ARGS)

demo: install
	$(RUN_ENV) $(PY) examples/heterogeneous_demo.py

perf: install
	@# Benchmarks print ratios measured side by side and write JSON to tests/perf/results/.
	set -e; for bench in tests/perf/bench_*.py; do $(RUN_ENV) $(PY) $$bench; done

clean:
	rm -rf build dist .pytest_cache $(VENV)/.installed
