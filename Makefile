# a3b-triton: `make serve` and `make test` do everything on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
MODEL_DIR ?= models/smollm2-135m-instruct
QWEN_TINY_DIR := models/qwen3.6-tiny
# One name for the profile everywhere: the server, the Kubernetes manifests and
# every target here read A3B_PROFILE.
A3B_PROFILE ?= cpu
ifeq ($(origin PROFILE),command line)
$(error PROFILE=$(PROFILE) is not read: name the profile with A3B_PROFILE=$(PROFILE), as make serve does)
endif

.PHONY: setup model model-qwen serve test test-distributed test-slow test-unit render perf-tools need-venv perf perf-inputs genai-perf aiperf locust locust-rag bench-overload bench-serving-path bench-entry-points bench-serving-cpu bench-overhead bench-overhead-goal overhead-runs bench-prefix-cache bench-long-context bench-shutdown bench-cpu-modes bench-cpu-linear bench-a3b bench-gpu gpu-check gpu-check-dry-run profile-gpu kv-report kernel-report quality quant-tools compare-quant compare-quant-a3b bench-convert-scale bench-qwen-fidelity bench-calibration-budget bench-block-tune bench-end-to-end-tune answer-margins clean

setup:
	bash scripts/setup.sh

# The bf16 checkpoint, then the served default: it in A3B with a3b-quantize's
# defaults (1x128 blocks, the built-in varied calibration text, one decoder layer at
# a time as the 35B model converts, error-compensating rounding) on 8,192 calibration
# tokens, not the converter's 65,536: that conversion alone took 39 minutes on 2 cores
# against 14 for this target, and its checkpoint answers the served tests' and the README's
# "What is the capital of France?" in broken French. Tuned end to end for 3 epochs, not
# the default 1: "Paris" on every prompt tried (make answer-margins; docs/quantization.md).
CALIBRATION_TOKENS ?= 8192
MODEL_TUNE_EPOCHS ?= 3
model: setup
	$(PY) -m a3b_backend.prepare.smollm2 --out $(MODEL_DIR)
	test -d $(MODEL_DIR)-a3b || $(PY) -m a3b_backend.quant.convert $(MODEL_DIR) $(MODEL_DIR)-a3b \
	  --calibration-tokens $(CALIBRATION_TOKENS) --tune-epochs $(MODEL_TUNE_EPOCHS)

# Qwen3.6-35B-A3B's architecture at toy width, random weights, and its A3B
# conversion: the `qwen-tiny` profile's model (A3B_PROFILE=qwen-tiny make serve),
# as the 35B model converts but on 8,192 tokens and untuned: its random weights give
# calibration nothing to find at any budget, and on them the end-to-end tune moves the
# excess NLL by under its standard error (make bench-qwen-fidelity), so both save make
# test's time.
QWEN_CALIBRATION_TOKENS ?= 8192
model-qwen: setup
	$(PY) -m a3b_backend.prepare.qwen_tiny --out $(QWEN_TINY_DIR)
	test -d $(QWEN_TINY_DIR)-a3b || $(PY) -m a3b_backend.quant.convert $(QWEN_TINY_DIR) $(QWEN_TINY_DIR)-a3b \
	  --calibration-tokens $(QWEN_CALIBRATION_TOKENS) --tune-epochs 0

render: setup
	$(PY) -m a3b_backend.deploy.repository

serve: setup model $(if $(filter qwen-tiny,$(A3B_PROFILE)),model-qwen)
	bash scripts/serve.sh

KERNEL_TESTS := tests/test_kernels_triton.py tests/test_kernels_triton_ops.py tests/test_kernels_kv.py tests/test_kernels_aot.py

test: setup model model-qwen
	$(PY) -m pytest -q tests -m "not distributed and not slow"
	@echo "==> the Triton kernel tests again under Triton 3.6 (the GPU hosts' version)"
	PYTHONPATH=$(VENV)/triton-3.6 A3B_EXPECT_TRITON=3.6 $(PY) -m pytest -q $(KERNEL_TESTS) -m "not slow"

# Kernel checks at Qwen3.6's real sizes under Triton's interpreter: minutes each, outside make test
test-slow: setup
	$(PY) -m pytest -q tests -m slow

# The default model over two vLLM nodes on loopback (profile cpu-2node, compiled
# mode: minutes to start), a node lost and started again; CI runs it after `make test`.
test-distributed: setup model
	$(PY) -m pytest -q tests -m distributed

test-unit: setup model model-qwen
	$(PY) -m pytest -q tests -m "not served and not slow"

perf-tools:
	bash scripts/perf_tools.sh

# perf_analyzer input files for a profile (A3B_PROFILE=cpu|h200|a100x8), exact token lengths
perf-inputs: setup model
	$(PY) -m a3b_backend.bench.perf_inputs --profile $(A3B_PROFILE) --out perf/inputs/$(A3B_PROFILE)

# Targets that measure a running server leave its environment alone (setup
# would rewrite files the server is using).
need-venv:
	@test -x $(PY) -a -d $(MODEL_DIR) || { echo "no .venv or model yet: run make serve first"; exit 1; }

# perf_analyzer sweep of the profile's plan against the running server (`make serve`), report under perf/results/
PERF_URL ?= localhost:8001
perf: need-venv perf-tools
	$(PY) perf/run_perf.py --profile $(A3B_PROFILE) --url $(PERF_URL) $(PERF_ARGS)

# genai-perf with its stock payloads against `ensemble`, in both request flavours
genai-perf: need-venv perf-tools
	for backend in vllm tensorrtllm; do \
	  bash scripts/genai_perf.sh profile -m ensemble --endpoint-type kserve --backend $$backend --streaming \
	    --tokenizer $(MODEL_DIR) -u $(PERF_URL) --synthetic-input-tokens-mean 64 --output-tokens-mean 16 \
	    --concurrency 2 --request-count 10 --artifact-dir perf/results/genai-perf/$$backend || exit 1; \
	done

# AIPerf (HTTP generate_stream, its template endpoint) beside genai-perf (gRPC), same load: perf/results/aiperf/
AIPERF_URL ?= http://localhost:8000
aiperf: need-venv perf-tools
	$(PY) perf/aiperf.py --http-url $(AIPERF_URL) --grpc-url $(PERF_URL) --tokenizer $(MODEL_DIR)

# locust against the HTTP generate endpoints (headless; drop --headless for its web UI)
LOCUST_HOST ?= http://localhost:8000
locust: need-venv perf-tools
	mkdir -p perf/results/locust
	.venv-genai/bin/locust -f perf/locustfile.py EnsembleUser --host $(LOCUST_HOST) --headless -u 4 -r 2 -t 60s \
	  --csv perf/results/locust/ensemble --only-summary
	$(PY) perf/locust_report.py perf/results/locust/ensemble --title "4 users on the ensemble's HTTP endpoints (make locust)"

# The profile's RAG mix (its perf input file: one shared document, a question each) over HTTP
# generate_stream, one request per LOCUST_RAG_INTERVAL_S per user, against the running server
LOCUST_RAG_USERS ?= 2
LOCUST_RAG_TIME ?= 300s
locust-rag: need-venv perf-tools
	$(PY) -m a3b_backend.bench.perf_inputs --profile $(A3B_PROFILE) --out perf/inputs/$(A3B_PROFILE) --length 128 --flavour vllm
	mkdir -p perf/results/locust_rag/$(A3B_PROFILE)
	LOCUST_RAG_INPUT=$$(ls perf/inputs/$(A3B_PROFILE)/rag*_vllm.json) .venv-genai/bin/locust -f perf/locustfile.py RagUser \
	  --host $(LOCUST_HOST) --headless -u $(LOCUST_RAG_USERS) -r $(LOCUST_RAG_USERS) -t $(LOCUST_RAG_TIME) \
	  --csv perf/results/locust_rag/$(A3B_PROFILE)/rag --only-summary
	$(PY) perf/locust_report.py perf/results/locust_rag/$(A3B_PROFILE)/rag \
	  --title "RAG mix at a fixed rate, profile $(A3B_PROFILE) (make locust-rag)"

# admitted-request latency and refusals past the admission limit, against the running server
bench-overload: need-venv perf-tools
	$(PY) perf/overload.py --profile $(A3B_PROFILE) --url $(PERF_URL)

# qwen-tiny served at 1K..130K-token prompts (gRPC and HTTP), the 86K RAG mix through the
# prefix cache, a cancelled 130K prefill: perf/results/long_context/ (its own server)
bench-long-context: setup model-qwen
	$(PY) perf/long_context.py

# TTFT on the RAG mix with and without prefix caching (its own engines)
bench-prefix-cache: setup model
	$(PY) perf/prefix_cache.py

# SIGTERM with ensemble streams in flight: the drain (starts its own server)
bench-shutdown: setup model
	$(PY) perf/shutdown.py

# the serving path's ceiling without the engine: our repository with a token
# source as a3b_llm, perf_analyzer at 1..256 streams (starts its own server);
# paced as a3b_llm sends, then unpaced, then one response per token
bench-serving-path: setup model perf-tools
	$(PY) perf/serving_path.py
	$(PY) perf/serving_path.py --sending coalesced --out perf/results/serving_path/unpaced
	$(PY) perf/serving_path.py --sending per-token --out perf/results/serving_path/per_token

# The two entry points on the same engine-free path, in turn at each level: ensemble, a3b_bls, and
# ensemble again (the A/A floor); perf/results/serving_path/entry_points/, ~5 min
bench-entry-points: setup model perf-tools
	$(PY) perf/serving_path.py --models ensemble a3b_bls ensemble --concurrency 1 4 16 64 \
	  --out perf/results/serving_path/entry_points

# bare AsyncLLM vs a3b_llm vs ensemble, same prompts, interleaved (starts its own server)
bench-overhead: setup model
	$(PY) perf/overhead.py

# the serving path's goals (the report says which a run met): bare AsyncLLM vs ensemble alone,
# 48 rounds at 8 and 32 streams (about 50 min)
bench-overhead-goal: setup model
	$(PY) perf/overhead.py --rounds 48 --concurrency 8 32 --variants c --out perf/results/overhead/goal

# the ensemble against bare AsyncLLM over the committed runs of that comparison on the 2-core AMD EPYC with
# EngineCore sleeping: each run's interval, and one that also holds the spread between runs
OVERHEAD_RUNS = rounds24_engine_sleeps rounds24_engine_sleeps_repeat goal_run1 goal_run2 goal second_engine
overhead-runs: setup
	$(PY) perf/overhead_runs.py $(addprefix perf/results/overhead/,$(OVERHEAD_RUNS))

# CPU per streamed token of each process of tritonserver's tree (stubs, engine): a3b_llm, ensemble and the
# ensemble at stream_interval 4 and 32, whose cost it splits into a part per response and a part per token
bench-serving-cpu: setup model
	$(PY) perf/serving_cpu.py

# vLLM eager/compiled x bf16/float32 on the cpu profile (why it runs eager float32)
bench-cpu-modes: setup model
	VLLM_CPU_KVCACHE_SPACE=1 $(PY) perf/cpu_engine_modes.py

# the CPU A3B linear: fused kernel vs dequantize + GEMM by rows (sets FUSED_MAX_ROWS)
bench-cpu-linear: setup
	$(PY) perf/cpu_linear.py

# bf16 vs A3B (each CPU strategy) side by side: speed, memory, greedy agreement
bench-a3b: setup model
	VLLM_CPU_KVCACHE_SPACE=1 $(PY) perf/a3b_vs_bf16.py

# llm-compressor in .venv-quant, for the peer checkpoints of compare-quant
quant-tools:
	bash scripts/quant_tools.sh

# A3B vs llm-compressor's GPTQ / AWQ W4A16 served by stock vLLM: perf/results/quant_compare/
# (a run converts each checkpoint into models/quant_compare/ unless one built by the same command
# from the same calibration text is there; times in docs/quantization.md)
compare-quant: setup model quant-tools
	$(PY) perf/quant_compare/compare.py

# A3B's own rows of compare-quant (no llm-compressor needed): a3b-quantize's defaults (tuned end to end),
# untuned, and uncalibrated, against bf16 through vLLM (perf/results/quant_compare/a3b/)
compare-quant-a3b: setup model
	$(PY) perf/quant_compare/compare.py --only bf16 A3B "A3B, no tuning" "A3B uncalibrated" \
		--out perf/results/quant_compare/a3b

# a3b-quantize on random checkpoints of 2 and 4 layers at Qwen3.6-35B-A3B's real width:
# peak RSS against layers, seconds per layer, rounding throughput, a 40-layer projection; then each tuned end to
# end (--tune-epochs 1): its memory, its time by part and its projection (perf/results/convert_scale/)
bench-convert-scale: setup model-qwen
	$(PY) perf/convert_scale.py

# a3b-quantize's defaults on SmolLM2 at 8,192 calibration tokens against its default 65,536 (make
# model's): perplexity in transformers on both held-out registers and conversion time at each
# (perf/results/calibration_budget/)
bench-calibration-budget: setup model
	$(PY) perf/calibration_budget.py

# block-wise tuning's settings on SmolLM2's first layers: each one's held-out loss against the
# error-compensating rounding it starts from, by step (perf/results/block_tune/)
bench-block-tune: setup model
	$(PY) perf/block_tune_sweep.py

# a3b-quantize's end-to-end tuning by epochs (untuned, 1 and 3), on SmolLM2 at make model's budget:
# perplexity on both held-out registers, held-out KL, times (perf/results/end_to_end_tune/)
bench-end-to-end-tune: setup model
	$(PY) perf/end_to_end_tune.py

# qwen-tiny's A3B conversions (uncalibrated, untuned, tuned) against its source, as built and with
# outlier RMSNorm channels: excess NLL on sequences it samples (perf/results/qwen_fidelity/)
bench-qwen-fidelity: setup model-qwen
	$(PY) perf/qwen_fidelity.py

# The Triton kernels compiled for sm_90a and sm_80 under Triton 3.6 and the venv's, read from their cubins:
# registers, spills, main-loop instructions and load widths, occupancy and waves at Qwen3.6's shapes;
# static, no GPU (perf/results/kernels_static/)
kernel-report: setup
	env -u TRITON_INTERPRET $(PY) perf/kernel_report.py

# A3B kernels on a CUDA GPU: checks against the references, then timings (perf/results/gpu/)
bench-gpu:
	$(PY) perf/gpu_kernels.py

# The prepared run for a rented H100/H200 (perf/gpu_check.py): custom ops under sync-debug and CUDA
# graphs, the CUDA extension's tests, then bench-gpu; gpu-check-dry-run shows and runs what a CPU can
gpu-check:
	$(PY) perf/gpu_check.py

gpu-check-dry-run: setup
	$(PY) perf/gpu_check.py --dry-run

# The A3B weight kernels under Nsight Compute (GPU only): throughput, occupancy, warp stalls
NCU ?= ncu
profile-gpu:
	$(NCU) --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
	  --section MemoryWorkloadAnalysis -k regex:a3b $(PY) perf/profile_gpu_kernels.py

# A3B KV cache (reference path): bytes per token, attention error, SmolLM2 perplexity change
kv-report: setup model
	$(PY) perf/kv_report.py

# A3B vs bf16 / RTN baselines: perplexity, bits per weight, table + plot under perf/quality
quality: setup model
	$(PY) -m a3b_backend.quant.quality

# The default model's greedy answers to the served tests' chat prompt and its neighbours, bf16 and
# A3B, with the margin each answer holds (perf/results/answer_margins/; transformers, ~2 min)
answer-margins: setup model
	$(PY) perf/answer_margins.py

clean:
	rm -rf $(VENV) models
