# a3b-triton: `make serve` and `make test` do everything on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
MODEL_DIR ?= models/smollm2-135m-instruct

.PHONY: setup model serve test test-unit render perf-tools bench-cpu-modes bench-a3b quality clean

setup:
	bash scripts/setup.sh

# The bf16 checkpoint, then the served default: it in A3B (1x128 blocks,
# calibrated on a text other than the quality report's; ~3 min on 2 cores).
model: setup
	$(PY) -m a3b_backend.prepare_model --out $(MODEL_DIR)
	test -d $(MODEL_DIR)-a3b || $(PY) -m a3b_backend.quant.convert $(MODEL_DIR) $(MODEL_DIR)-a3b \
	  --calibration-text /usr/share/common-licenses/GPL-3

render: setup
	$(PY) -m a3b_backend.repository

serve: setup model
	bash scripts/serve.sh

test: setup model
	$(PY) -m pytest -q tests

test-unit: setup model
	$(PY) -m pytest -q tests -m "not served"

perf-tools:
	bash scripts/perf_tools.sh

# vLLM eager/compiled x bf16/float32 on the cpu profile (why it runs eager float32)
bench-cpu-modes: setup model
	VLLM_CPU_KVCACHE_SPACE=1 $(PY) perf/cpu_engine_modes.py

# bf16 vs A3B (each CPU strategy) side by side: speed, memory, greedy agreement
bench-a3b: setup model
	VLLM_CPU_KVCACHE_SPACE=1 $(PY) perf/a3b_vs_bf16.py

# A3B vs bf16 / RTN baselines: perplexity, bits per weight, table + plot under perf/quality
quality: setup model
	$(PY) -m a3b_backend.quant.quality

clean:
	rm -rf $(VENV) models
