# The two commands of the README: `make demo` and `make test`. Each sets up .venv
# (python3, pip) on a fresh machine, then runs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# pytest-xdist: the suite waits on Ray and servers; two processes, each with its own
# local Ray, keep both cores busy (a test file stays on one process, its fixtures shared)
TEST_WORKERS ?= 2

.PHONY: setup data bytecode demo test lint format bench tables clean stack-up stack-down

setup: $(STAMP) data

# constraints.txt: the exact torch and torchvision builds (pyproject.toml states ranges).
# pip byte-compiles one file at a time; compileall uses every core (the venv's 21,552
# files: 60.6 s with -j 1, 36.2 s with -j 0 on 2 cores). Files written for newer Pythons
# (torch's py312 test helpers) fail to compile there as they do, silently, under pip:
# hence -qq, and its status not counted.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --no-compile -c constraints.txt -e '.[test]'
	$(BIN)/python -m compileall -qq -j 0 $(VENV)/lib || true
	touch $(STAMP)

# Fashion-MNIST from Debian's package, where apt is available and we are root.
data:
	@if [ ! -d /usr/share/datasets/fashion-mnist ] && command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist >/dev/null || \
		echo "note: could not install dataset-fashion-mnist; Fashion-MNIST datasets will need root=DIR or SPLITVIT_DATA_DIR"; \
	fi

# The project's own sources, compiled for every process that imports them: with
# PYTHONDONTWRITEBYTECODE set (as on the project machines) each Ray worker, trial and
# subprocess would compile them again (0.2 CPU-s each; a test run starts over 200). Only
# changed files are compiled again; __pycache__ is git-ignored.
bytecode: setup
	$(BIN)/python -m compileall -qq -j 0 platform tests

demo: setup bytecode
	$(BIN)/splitvit sweep search_spaces/smoke.yaml --json runs/sweep.json

test: setup bytecode
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# ruff and import-linter, configured in pyproject.toml: `make lint` checks (CI runs it),
# `make format` rewrites. lint-imports: the dependency rules of docs/design.md §2.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports --no-cache

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: setup
	$(BIN)/splitvit bench forward --json runs/bench/forward.json

# The tables of docs/results.md, printed again from the committed JSON in docs/measurements/
# (scripts/; tests/test_scripts.py checks their figures against that JSON)
tables: setup
	$(BIN)/python scripts/study_tables.py
	$(BIN)/python scripts/ablation_table.py --study classification
	$(BIN)/python scripts/ablation_table.py --study dense
	$(BIN)/python scripts/policy_cost_ablation.py table
	$(BIN)/python scripts/sweep_vs_recipe.py docs/measurements/cpu-2026-12-06-sweep/sweep_classification_cpu.json \
		--recipe-points docs/measurements/cpu-2026-12-06-sweep/recipe_points.json
	$(BIN)/python scripts/sweep_vs_recipe.py docs/measurements/cpu-2026-12-06-sweep-v2/sweep_classification_cpu_v2.json \
		--recipe-points docs/measurements/cpu-2026-12-06-sweep-v2/recipe_points.json
	$(BIN)/python scripts/sweep_vs_recipe.py docs/measurements/cpu-2026-12-06-sweep-v2/frontier_val5000.json \
		--recipe-points docs/measurements/cpu-2026-12-06-sweep-v2/recipe_points.json
	$(BIN)/python scripts/sweep_vs_recipe.py docs/measurements/cpu-2026-12-06-sweep-v3/sweep_classification_cpu_v3.json \
		--recipe-points docs/measurements/cpu-2026-12-06-sweep-v3/recipe_points.json
	$(BIN)/python scripts/sweep_vs_recipe.py docs/measurements/cpu-2026-12-07-sweep-v5/sweep_classification_cpu_v5.json \
		--recipe-points docs/measurements/cpu-2026-12-07-sweep-v5/recipe_points.json \
		--study docs/measurements/cpu-2026-12-07-cls-v2/study_fashion_v2_side.json

# The local stack (infra/local): a Ray head with its dashboard/job server on
# 127.0.0.1:8265 and an MLflow server on 127.0.0.1:5000. STACK_ARGS passes options.
STACK_ARGS ?=

stack-up: setup
	$(BIN)/splitvit stack up $(STACK_ARGS)

stack-down:
	@if [ -x $(BIN)/splitvit ]; then $(BIN)/splitvit stack down $(STACK_ARGS); else echo "no $(BIN)/splitvit: nothing to stop"; fi

clean:
	rm -rf runs .pytest_cache
