# The two quick-start commands: `make demo` (a real training run on a local cluster) and
# `make test`. Each sets itself up: a virtual environment in .venv with the pinned dependencies.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
INVENTORY ?= inventory/local.yaml
PYTEST_ARGS ?=

.PHONY: venv bytecode demo test test-fast test-fakes lint unit docs bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,notebook]'
	touch $(STAMP)

venv: $(STAMP)

# The sources' bytecode, for the tests (see `test`): compileall skips what is up to date.
bytecode: venv
	$(BIN)/python -m compileall -q client server tests bench >/dev/null

# What a first `make demo` or `make docs` says before pip starts: pip -q prints nothing for minutes.
SETUP_NOTICE := first, a virtual environment in $(VENV): pip installs dtf with TensorFlow (CPU), tf-keras \
    and the test and notebook tools, about 2.5 GB. It takes about 4 minutes, and pip prints nothing until it is done.

# Up, train the first example, down (down runs even when training fails). The environment comes
# first, and the notice before it when it is to be made (`make -q venv` fails then).
demo:
	@$(MAKE) -q venv 2>/dev/null || echo "make demo: $(SETUP_NOTICE)"
	@$(MAKE) -s --no-print-directory venv
	$(BIN)/dtf up $(INVENTORY)
	$(BIN)/dtf train --output dtf-output/mnist_fit examples/mnist_fit.py; rc=$$?; \
	$(BIN)/dtf down; exit $$rc

# Everything: unit, CLI, local-cluster and SSH-lab end-to-end tests (the lab needs root and
# openssh-server; under CI=true a lab that cannot start fails the run instead of skipping).
# TEST_WORKERS processes run the tests (pytest-xdist): on 2 cores a run is CPU-bound (most of
# it TensorFlow programs and the training they run), and three
# keep both cores busy while one waits on a lease, a timeout or a barrier. Each process that
# runs lab tests builds its own SSH lab (tests/lab.py picks a free name and subnet). The 15
# slowest tests are listed at the end. Tests that share a module's cluster are one xdist_group
# (--dist loadgroup): they run on one worker, which starts that cluster once.
# The sources are compiled to bytecode first: where PYTHONDONTWRITEBYTECODE is set (as in many
# container images) Python never writes it, and every dtf command of the tests (hundreds) would
# compile dtf's modules anew. compileall skips what is up to date.
TEST_WORKERS ?= 3
test: bytecode
	$(BIN)/python -m pytest -q -rs -n $(TEST_WORKERS) --dist loadgroup --durations=15 $(PYTEST_ARGS)

# The fast tier: the pure and CLI tests, and one up/status/down of the real CLI,
# launcher and supervisors against fake servers on local processes (no TensorFlow is imported).
# FAST_WORKERS processes (pytest-xdist; `make test` runs these tests side by side too): much of
# the tier's time is tests waiting out a deadline they test, which the other process fills.
# The property tests run a quarter of their examples (the `fast` profile of tests/conftest.py).
FAST_WORKERS ?= 2
test-fast: bytecode
	$(BIN)/python -m pytest -q -rs -m "not tf and not lab" -p no:cacheprovider -n $(FAST_WORKERS) \
	    --hypothesis-profile=fast tests/unit "tests/fake/test_lifecycle.py::test_up_status_down[local]" $(PYTEST_ARGS)

# Every fake-server test (no TensorFlow), on local processes and on the SSH lab.
# The SSH-lab part runs beside the rest (one lab per machine: it cannot be split across workers).
test-fakes: bytecode
	@$(BIN)/python -m pytest -q -rs -m "lab and not tf" -p no:cacheprovider $(PYTEST_ARGS) \
	    > $(VENV)/test-fakes-lab.log 2>&1 & lab=$$!; \
	$(BIN)/python -m pytest -q -rs -m "not tf and not lab" -p no:cacheprovider tests/fake $(PYTEST_ARGS); rc=$$?; \
	wait $$lab; lab_rc=$$?; echo "--- the SSH-lab part ($(VENV)/test-fakes-lab.log):"; \
	cat $(VENV)/test-fakes-lab.log; [ $$rc -eq 0 ] && [ $$lab_rc -eq 0 ]

unit: bytecode
	$(BIN)/python -m pytest -q tests/unit

# Linter, and the type checker (strict on the client and on the host package alike); shellcheck
# for the sh programs dtf runs on a Slurm cluster (ruff reads their Python beside them).
lint: venv
	$(BIN)/ruff check client server tests bench examples
	$(BIN)/mypy -p dtf -p dtf_server
	$(BIN)/shellcheck client/dtf/hosts/scripts/*.sh client/dtf/providers/slurm/scripts/*.sh

# The documentation site from docs/ (mkdocs.yml), into build/site; --strict makes every warning
# (a broken link or anchor, a page left out of the nav) an error. Not --quiet: it hides the
# warnings from --strict, and the build passes. After the build, tests/docsite.py (a hook in
# mkdocs.yml) fails it if a page's link or asset is not a file of the site (opened from disk).
DOCS_STAMP := $(VENV)/.docs-stamp
$(DOCS_STAMP): pyproject.toml $(STAMP)
	$(BIN)/python -m pip install -q -e '.[test,notebook,docs]'
	touch $(DOCS_STAMP)

docs:
	@$(MAKE) -q venv 2>/dev/null || echo "make docs: $(SETUP_NOTICE)"
	@$(MAKE) -s --no-print-directory $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: venv
	$(BIN)/python bench/provision.py
	$(BIN)/python bench/faults.py

clean:
	rm -rf $(VENV) dtf-output .pytest_cache
