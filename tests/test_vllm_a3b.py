"""The vLLM "a3b" method: tiny converted checkpoints load in vLLM on the CPU and
compute what transformers computes with the dequantized weights; malformed
checkpoints fail at load naming the tensor and the problem."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from a3b_backend.quant.convert import convert
from a3b_backend.quant.dequantized import float_model
from a3b_backend.quant.format import A3BConfig
from test_quant_convert import MOE, tiny

PROBE = Path(__file__).with_name("vllm_probe.py")
CONFIG = A3BConfig(1, 32, iterations=2)
# vLLM's CPU attention needs head_dim >= 32.
VLLM_SHAPE = dict(hidden_size=128, head_dim=32)
PROMPT = [3, 17, 42, 99, 7, 128, 200, 5, 64, 31, 250, 11]
# The MoE model carries Qwen's vocabulary (its BPE from the dashscope package)
# and reads a real sentence tokenized with it.
QWEN_VOCAB = 151936
QWEN_TEXT = "The capital of France is Paris. Mixture-of-experts layers route each token to two experts."
# Max |log p| difference between vLLM (float32, A3B kernels) and transformers
# (float32, dequantized weights): summation order only; the log-softmax over
# Qwen's 151936-token vocabulary sums 600x more terms (seen: 2.3e-3 on
# log-probs near -12, 2e-4 relative).
LOGPROB_TOLERANCE = {"llama": 2e-3, "qwen3_moe": 5e-3}
# The Triton branch multiplies prefill rows on fp16 tensor-core dots (x and the table values in
# fp16, float32 sums); measured under the venv's Triton 3.9 interpreter: 1.6e-4 (llama) and 2.4e-4
# (qwen3_moe), both runs 70 s together.
TRITON_TOLERANCE = 2e-3


def probe(mode: str, model_dir: Path, *args: str, prompt: list[int] = PROMPT,
          env: dict[str, str] | None = None) -> tuple[object | None, str]:
    done = subprocess.run([sys.executable, str(PROBE), mode, str(model_dir), ",".join(map(str, prompt)), *args],
                          capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})
    line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
    return (json.loads(line[len("RESULT "):]) if line else None), done.stdout + done.stderr


def reference_logprobs(model, prompt: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    return [logp[i - 1, prompt[i]].item() for i in range(1, len(prompt))]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("llama")
    src = tiny(tmp, "llama", **VLLM_SHAPE)
    return src, convert(src, tmp / "a3b", CONFIG)


@pytest.mark.parametrize("model_type, extra", [
    ("llama", {}),
    ("qwen3_moe", dict(MOE, decoder_sparse_step=1, vocab_size=QWEN_VOCAB)),
])
def test_vllm_logits_match_dequantized_reference(tmp_path, model_type, extra):
    src = tiny(tmp_path, model_type, **VLLM_SHAPE, **extra)
    dst = convert(src, tmp_path / "a3b", CONFIG)
    prompt = PROMPT
    if model_type == "qwen3_moe":
        from a3b_backend.bench.perf_inputs import QwenTokenizer

        prompt = QwenTokenizer.load().encode(QWEN_TEXT)
        assert len(prompt) > 10 and max(prompt) > 256
    logprobs, log = probe("prompt-logprobs", dst, prompt=prompt)
    assert logprobs is not None, log[-4000:]
    expected = reference_logprobs(float_model(dst), prompt)
    diff = max(abs(a - b) for a, b in zip(logprobs, expected))
    assert diff < LOGPROB_TOLERANCE[model_type], (diff, logprobs, expected)


@pytest.mark.parametrize("model_type, extra", [
    ("llama", {}),
    ("qwen3_moe", dict(MOE, decoder_sparse_step=1)),
])
def test_vllm_runs_the_triton_branch_on_the_cpu(tmp_path, model_type, extra):
    """vLLM's real call path into the GPU branch (process_weights_after_loading's kernel choice, the
    linear and MoE methods' apply with vLLM's int32 top-k ids, the custom ops) on the CPU: the
    Triton kernels under Triton's interpreter, at the GPU kernels' 1x128 blocks."""
    from a3b_backend.engine.a3b_method import KERNEL_ENV

    src = tiny(tmp_path, model_type, **VLLM_SHAPE, **extra)
    dst = convert(src, tmp_path / "a3b", A3BConfig(1, 128, iterations=2))
    logprobs, log = probe("prompt-logprobs", dst, env={KERNEL_ENV: "triton", "TRITON_INTERPRET": "1"})
    assert logprobs is not None, log[-4000:]
    assert "Triton a3b::gpu_linear path" in log and ("Triton a3b::gpu_moe path" in log) == (model_type != "llama")
    expected = reference_logprobs(float_model(dst), PROMPT)
    diff = max(abs(a - b) for a, b in zip(logprobs, expected))
    assert diff < TRITON_TOLERANCE, (diff, logprobs, expected)


def _edit(src: Path, dst: Path, config_edit=None, tensor_edit=None) -> Path:
    import shutil

    shutil.copytree(src, dst)
    if config_edit:
        config = json.loads((dst / "config.json").read_text())
        config_edit(config["quantization_config"])
        (dst / "config.json").write_text(json.dumps(config))
    if tensor_edit:
        for shard in dst.glob("*.safetensors"):
            tensors = load_file(shard)
            tensor_edit(tensors)
            save_file(tensors, shard, metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("case, config_edit, tensor_edit, message", [
    ("version", lambda c: c.update(version=2), None, r"quantization_config\.version = 2 is not supported"),
    ("block", lambda c: c.update(block_shape=[1, 16]), None,
     r"model\.layers\.\d\.\S+\.weight_(lo|step|delta) has shape \[\d+, \d\]; a \[\d+, \d+\] weight in 1x16 "
     r"blocks \(quantization_config.block_shape\) needs \[\d+, \d+\]"),
    ("missing", None, lambda t: t.pop("model.layers.1.mlp.up_proj.weight_step"),
     r"A3B tensors missing from the checkpoint: model\.layers\.1\.mlp\.up_proj\.weight_step"),
])
def test_malformed_checkpoint_fails_at_load_naming_the_tensor(llama, tmp_path, case, config_edit, tensor_edit,
                                                              message):
    bad = _edit(llama[1], tmp_path / case, config_edit, tensor_edit)
    result, log = probe("greedy", bad, "2")
    assert result is None
    assert re.search(message, log), log[-4000:]


def test_linear_kernels_names_ours_and_which_of_vllms_cpu_kernels_loaded():
    from a3b_backend.bench.engine_probes import linear_kernels

    def layer(**attributes) -> torch.nn.Module:
        module = torch.nn.Module()
        module.__dict__.update(attributes)
        return module

    model = torch.nn.ModuleList([layer(a3b=object()), layer(use_w4a8=True, isa_hint="amx"),
                                 layer(use_w4a8=False, isa_hint="amx"), torch.nn.Linear(2, 2)])
    assert linear_kernels(model) == ["A3B plugin", "cpu_gemm_wna16 (amx)", "int4_scaled_mm_cpu (W4A8)"]
    assert linear_kernels(torch.nn.Linear(2, 2)) == ["vLLM's bf16 GEMM"]
