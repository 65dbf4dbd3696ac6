"""Every profile's engine arguments through vLLM's own config validation, here
without GPUs: AsyncEngineArgs built from the profile and vLLM's whole engine
config created against Qwen3.6-35B-A3B's real sizes (a config-only
checkpoint: qwen-tiny's A3B config at full width).

What this cannot check (it runs on vLLM's CPU platform): GPU memory and the
KV-cache size at 0.92 utilization, the attention backend's fp8 KV support,
NCCL across GPUs and nodes, and our CUDA / Triton kernels (their own tests)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from a3b_backend.prepare.qwen_tiny import FULL_SIZE
from a3b_backend.profiles import MODEL_DIR_ENV, NODE_RANK_ENV, PROFILES, PROJECT_ROOT

QWEN_TINY = PROJECT_ROOT / "models" / "qwen3.6-tiny-a3b"
GPU_PROFILES = sorted(name for name, p in PROFILES.items() if p.gpus_per_node)


@pytest.fixture(scope="module")
def full_size_config(tmp_path_factory) -> Path:
    if not (QWEN_TINY / "config.json").exists():
        pytest.fail(f"{QWEN_TINY} missing: run `make model-qwen`")
    out = tmp_path_factory.mktemp("qwen3.6-35b-a3b-config")
    config = json.loads((QWEN_TINY / "config.json").read_text())
    layers = FULL_SIZE["num_hidden_layers"]
    config.update(FULL_SIZE, layer_types=[config["layer_types"][i % 4] for i in range(layers)])
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy2(QWEN_TINY / name, out / name)
    return out


@pytest.mark.parametrize("name", GPU_PROFILES)
def test_gpu_profile_builds_vllms_engine_config(name, full_size_config, monkeypatch):
    from vllm.engine.arg_utils import AsyncEngineArgs

    profile = PROFILES[name]
    monkeypatch.setenv(MODEL_DIR_ENV, str(full_size_config))
    args = AsyncEngineArgs(**profile.engine_args(PROJECT_ROOT))
    config = args.create_engine_config()
    parallel = config.parallel_config
    assert (parallel.tensor_parallel_size, parallel.pipeline_parallel_size) == (
        profile.tensor_parallel_size, profile.pipeline_parallel_size)
    assert parallel.world_size == max(profile.gpus_per_node, 1) * profile.nodes
    assert parallel.nnodes == profile.nodes and parallel.enable_expert_parallel == profile.enable_expert_parallel
    assert config.model_config.max_model_len == profile.max_model_len
    assert config.model_config.quantization == "a3b"
    assert config.cache_config.cache_dtype == profile.kv_cache_dtype


def test_secondary_node_gets_its_rank_and_the_rendezvous(monkeypatch):
    monkeypatch.setenv(NODE_RANK_ENV, "1")
    monkeypatch.setenv("A3B_MASTER_ADDR", "10.0.0.7")
    args = PROFILES["multinode"].engine_args(PROJECT_ROOT)
    assert (args["nnodes"], args["node_rank"], args["master_addr"], args["master_port"]) == (2, 1, "10.0.0.7", 29501)
    assert args["distributed_executor_backend"] == "mp"
    assert "nnodes" not in PROFILES["h200"].engine_args(PROJECT_ROOT)
    # a lost node fails the step after this long, not after vLLM's 300 s
    assert PROFILES["cpu-2node"].engine_env()["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] == "30"


def test_cpu_2node_is_the_cpu_profile_across_two_nodes():
    """Derived from `cpu` by the function that derives `multinode` from `a100x8`: only the placement differs."""
    import dataclasses

    cpu, two = PROFILES["cpu"], PROFILES["cpu-2node"]
    placement = {"name", "nodes", "pipeline_parallel_size", "distributed_executor_backend", "execute_timeout_s",
                 "enforce_eager"}
    differ = {f.name for f in dataclasses.fields(cpu) if getattr(cpu, f.name) != getattr(two, f.name)}
    assert differ == placement
    a100, multinode = PROFILES["a100x8"], PROFILES["multinode"]
    assert {f.name for f in dataclasses.fields(a100) if getattr(a100, f.name) != getattr(multinode, f.name)} \
        <= placement


@pytest.mark.parametrize("dtype, avx512, refused", [("fp8", False, True), ("fp8_e4m3", False, True),
                                                    ("fp8", True, False), ("auto", False, False)])
def test_an_fp8_kv_cache_on_a_cpu_without_avx512_or_amx_is_refused_naming_both(monkeypatch, dtype, avx512, refused):
    import torch

    from a3b_backend.engine.host import cpu_kv_cache_problem

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: avx512)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    problem = cpu_kv_cache_problem({"kv_cache_dtype": dtype})
    assert (problem is not None) == refused
    if refused:
        assert f"kv_cache_dtype {dtype!r}" in problem and "AVX-512 or AMX" in problem
