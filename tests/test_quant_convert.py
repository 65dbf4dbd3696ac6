"""Converter: dense Llama and MoE checkpoints (tiny random ones built here), refusals, atomic output."""
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from a3b_backend.quant.convert import ConversionError, convert
from a3b_backend.quant.format import A3BConfig, A3BWeight, dequantize

CONFIG = A3BConfig(1, 32, iterations=2)  # the converter tests' quantizer


def tiny(tmp_path: Path, model_type: str, vocab_size: int = 256, **extra) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=vocab_size)
    cfg = AutoConfig.for_model(model_type, **{**shape, **extra})
    torch.manual_seed(0)
    path = tmp_path / model_type
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in path.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
QWEN35 = dict(MOE, shared_expert_intermediate_size=32, layer_types=["linear_attention", "full_attention"],
              linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)


@pytest.mark.parametrize("model_type, extra, expected", [
    ("llama", {}, ["self_attn.q_proj", "mlp.down_proj"]),
    ("qwen3_moe", dict(MOE, decoder_sparse_step=1), ["mlp.experts.3.up_proj", "self_attn.o_proj"]),
    ("qwen3_5_moe_text", QWEN35, ["linear_attn.in_proj_qkv", "linear_attn.out_proj", "mlp.shared_expert.down_proj",
                                  "mlp.experts.0.gate_proj", "self_attn.k_proj"]),
])
def test_converts_dense_and_moe(tmp_path, model_type, extra, expected):
    src = tiny(tmp_path, model_type, **extra)
    dst = convert(src, tmp_path / "out", CONFIG)
    before, after = tensors(src), tensors(dst)
    for suffix in expected:
        name = next(n for n in before if n.endswith(suffix + ".weight"))
        q = A3BWeight.from_tensors(after, name)
        w = before[name].float()
        assert name not in after
        assert ((dequantize(q, CONFIG) - w).norm() / w.norm()) < 0.2
    for kept in ("model.embed_tokens.weight", "model.norm.weight"):
        assert torch.equal(after[kept], before[kept])
    assert not any(n.endswith("mlp.gate.weight") and n not in after for n in before)  # routers stay
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "a3b"
    assert config["quantization_config"]["block_shape"] == [1, 32]


def _dequantized_model(dst: Path, src: Path):
    """The source architecture with dst's tensors, A3B weights dequantized."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    stored = tensors(dst)
    state = {}
    for name in model.state_dict():
        state[name] = (dequantize(A3BWeight.from_tensors(stored, name), CONFIG) if f"{name}_packed" in stored
                       else stored.get(name, model.state_dict()[name]).float())
    model.load_state_dict(state)
    return model


def test_calibrated_checkpoint_computes_what_the_source_does(tmp_path, tokenizer, monkeypatch):
    """Folded AWQ scales (norm / s, weight * s) must leave the function intact up to quantization error."""
    from transformers import AutoModelForCausalLM

    from a3b_backend.quant import calibrate

    monkeypatch.setattr(calibrate, "ALPHAS", (0.75,))  # force a real scale, so the fold is exercised
    src = tiny(tmp_path, "llama", vocab_size=len(tokenizer))
    tokenizer.save_pretrained(src)
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    dst = convert(src, tmp_path / "out", CONFIG, calibration_text=text, calibration_tokens=128)
    assert json.loads((dst / "config.json").read_text())["quantization_config"]["calibrated"] is True
    ids = torch.tensor([tokenizer.encode("A lazy dog sleeps in the sun all day.")])
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)(ids).logits
        got = _dequantized_model(dst, src)(ids).logits
    assert ((got - ref).norm() / ref.norm()) < 0.1
    norm = "model.layers.0.input_layernorm.weight"
    assert not torch.equal(tensors(dst)[norm], tensors(src)[norm])


def test_refusals(tmp_path):
    src = tiny(tmp_path, "llama")
    with pytest.raises(ConversionError, match="would overwrite or nest"):
        convert(src, src, CONFIG)
    with pytest.raises(ConversionError, match="config.json is missing"):
        convert(tmp_path / "nowhere", tmp_path / "out", CONFIG)
    binary = tmp_path / "bin_ckpt"
    binary.mkdir()
    (binary / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (binary / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ConversionError, match="no .safetensors weights"):
        convert(binary, tmp_path / "out", CONFIG)
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    save_file({"x": torch.zeros(2)}, odd / "model.safetensors")
    with pytest.raises(ConversionError, match="architecture 'bert'"):
        convert(odd, tmp_path / "out", CONFIG)


def test_failed_run_leaves_nothing_that_looks_complete(tmp_path):
    src = tiny(tmp_path, "llama")
    shard = next(src.glob("*.safetensors"))
    with safe_open(shard, "pt") as f:
        weights = {k: f.get_tensor(k) for k in f.keys()}
    weights["model.layers.1.mlp.up_proj.weight"][0, 0] = float("nan")
    save_file(weights, shard)
    with pytest.raises(Exception, match="model.layers.1.mlp.up_proj.weight"):
        convert(src, tmp_path / "out", CONFIG)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_stacked_expert_tensors_quantize_per_expert():
    from a3b_backend.quant.convert import convert_tensor

    stacked = torch.randn(3, 16, 64) * 0.02
    out, count = convert_tensor("model.layers.0.mlp.experts.gate_up_proj", stacked, CONFIG, {}, {})
    assert count == stacked.numel()
    name = "model.layers.0.mlp.experts.gate_up_proj"
    assert out[f"{name}_packed"].shape == (3, 16, 32)
    for e in range(3):
        q = A3BWeight.from_tensors({k: v[e] for k, v in out.items()}, name)
        assert ((dequantize(q, CONFIG) - stacked[e]).norm() / stacked[e].norm()) < 0.2
