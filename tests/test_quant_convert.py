"""Converter: dense Llama and MoE checkpoints (tiny random ones built here), uncalibrated and through
the layer pipeline, refusals, atomic output."""
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from a3b_backend.quant.checkpoint import INPUT_SCALES_FILE, ROW_DIVISORS_FILE

from a3b_backend.quant.convert import ConversionError, convert, fold_norm_scale, main
from a3b_backend.quant.dequantized import float_model, stored_tensors
from a3b_backend.quant.format import A3BConfig, A3BWeight, dequantize
from a3b_backend.quant.sequential import convert_layers

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


tensors = stored_tensors


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
    assert json.loads((dst / "config.json").read_text())["quantization_config"]["rounding"] == "nearest"
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


@pytest.mark.parametrize("model_type, extra, norm", [
    ("llama", {}, "model.layers.0.input_layernorm.weight"),
    # zero-centred norms; its full-attention layer's q/k/v fold into input_layernorm
    ("qwen3_5_moe_text", QWEN35, "model.layers.1.input_layernorm.weight"),
])
def test_calibrated_checkpoint_computes_what_the_source_does(tmp_path, tokenizer, monkeypatch, model_type, extra,
                                                             norm):
    """Folded AWQ scales (norm / s, weight * s) must leave the function intact up to quantization error."""
    from transformers import AutoModelForCausalLM

    from a3b_backend.quant import calibrate

    monkeypatch.setattr(calibrate, "ALPHAS", (0.75,))  # force a real scale, so the fold is exercised
    src = tiny(tmp_path, model_type, vocab_size=len(tokenizer), **extra)
    tokenizer.save_pretrained(src)
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    dst = convert_layers(src, tmp_path / "out", CONFIG, text, 128, rounding="nearest")
    assert json.loads((dst / "config.json").read_text())["quantization_config"]["calibrated"] is True
    ids = torch.tensor([tokenizer.encode("A lazy dog sleeps in the sun all day.")])
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)(ids).logits
        got = float_model(dst)(ids).logits
    # quantization error of a tiny random model calibrated on one sentence, its quantized outputs passed
    # on layer to layer: 0.11 on the Llama one (the folds themselves are checked exactly below)
    assert ((got - ref).norm() / ref.norm()) < 0.15
    assert not torch.equal(tensors(dst)[norm], tensors(src)[norm])
    # the scales the norm absorbed are kept, one per linear reading it
    scales = load_file(dst / INPUT_SCALES_FILE)
    layer = norm.removesuffix(".input_layernorm.weight")
    q, k = scales[f"{layer}.self_attn.q_proj"], scales[f"{layer}.self_attn.k_proj"]
    assert torch.equal(q, k)
    assert torch.equal(fold_norm_scale(tensors(src)[norm], q, model_type != "llama"), tensors(dst)[norm])
    # down_proj's scale went into up_proj's rows (a dense MLP, or the MoE block's shared expert)
    mlp = f"{layer}.mlp" + ("" if model_type == "llama" else ".shared_expert")
    assert torch.equal(load_file(dst / ROW_DIVISORS_FILE)[f"{mlp}.up_proj"], scales[f"{mlp}.down_proj"])


@pytest.mark.parametrize("model_type, extra", [("llama", {}), ("qwen3_5_moe_text", QWEN35)])
def test_gptq_rounded_checkpoint_computes_what_the_source_does(tmp_path, tokenizer, model_type, extra):
    from transformers import AutoModelForCausalLM

    src = tiny(tmp_path, model_type, vocab_size=len(tokenizer), **extra)
    tokenizer.save_pretrained(src)
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    nearest = convert_layers(src, tmp_path / "nearest", CONFIG, text, 128, rounding="nearest")
    gptq = convert_layers(src, tmp_path / "gptq", CONFIG, text, 128)  # the default
    assert json.loads((gptq / "config.json").read_text())["quantization_config"]["rounding"] == "gptq"
    ids = torch.tensor([tokenizer.encode("A lazy dog sleeps in the sun all day.")])
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)(ids).logits
        got = float_model(gptq)(ids).logits
    # a sanity bound: on a tiny random model calibrated on one repeated sentence, nearest rounding
    # lands at ~0.09 and gptq at ~0.13 (its Hessian is fitted to that sentence)
    assert ((got - ref).norm() / ref.norm()) < 0.2
    name = "model.layers.0.mlp.down_proj.weight_packed" if model_type == "llama" else \
        "model.layers.1.self_attn.q_proj.weight_packed"
    assert not torch.equal(tensors(gptq)[name], tensors(nearest)[name])


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
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    (renamed / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"transformer.h.0.attn.c_attn.weight": torch.zeros(2, 2)}, renamed / "model.safetensors")
    with pytest.raises(ConversionError, match="no decoder layers found under any known layout"):
        convert(renamed, tmp_path / "out", CONFIG)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("options, named", [
    (["--rounding", "gptq"], "cannot take --rounding gptq"),
    (["--tune-epochs", "1"], "cannot take --tune-epochs"),
    (["--tune-steps", "5", "--device", "cuda"], "cannot take --tune-steps, --device"),
    (["--calibration-tokens", "512"], "cannot take --calibration-tokens"),
])
def test_options_that_need_calibration_are_refused_uncalibrated_naming_them(tmp_path, capsys, options, named):
    src = tiny(tmp_path, "llama")
    assert main([str(src), str(tmp_path / "out"), "--block-shape", "1", "32", "--cpu-only-blocks", "--uncalibrated",
                 *options]) == 2
    assert f"--uncalibrated runs no model, so it {named}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_removed_whole_model_pipeline_is_refused_naming_the_one_left(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([str(tiny(tmp_path, "llama")), str(tmp_path / "out"), "--pipeline", "model"])
    err = capsys.readouterr().err
    assert "--pipeline: invalid choice: 'model'" in err and "layers" in err


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


def test_stacked_experts_are_written_per_expert():
    from a3b_backend.quant.convert import convert_tensor

    gate_up = torch.randn(3, 32, 64) * 0.02  # [E, 2I, H]: gate rows, then up rows
    out, count = convert_tensor("model.language_model.layers.0.mlp.experts.gate_up_proj", gate_up, CONFIG)
    assert count == gate_up.numel()
    for e in range(3):
        for proj, rows in (("gate_proj", gate_up[e, :16]), ("up_proj", gate_up[e, 16:])):
            name = f"model.language_model.layers.0.mlp.experts.{e}.{proj}.weight"
            q = A3BWeight.from_tensors(out, name)
            assert ((dequantize(q, CONFIG) - rows).norm() / rows.norm()) < 0.2
    down, _ = convert_tensor("model.language_model.layers.0.mlp.experts.down_proj", torch.randn(3, 64, 16), CONFIG)
    assert A3BWeight.from_tensors(down, "model.language_model.layers.0.mlp.experts.2.down_proj.weight").in_features == 16


def test_published_multimodal_layout_converts(tmp_path):
    """Qwen3.6's published layout built tiny: the text model under model.language_model.,
    stacked experts, a vision tower and an MTP layer; only the text model's linears are quantized."""
    src = tmp_path / "qwen36-layout"
    src.mkdir()
    g = torch.Generator().manual_seed(0)
    layer = "model.language_model.layers.0."
    weights = {
        "model.language_model.embed_tokens.weight": torch.randn(256, 64, generator=g),
        f"{layer}self_attn.q_proj.weight": torch.randn(64, 64, generator=g),
        f"{layer}linear_attn.in_proj_qkv.weight": torch.randn(96, 64, generator=g),
        f"{layer}linear_attn.in_proj_a.weight": torch.randn(4, 64, generator=g),
        f"{layer}mlp.gate.weight": torch.randn(4, 64, generator=g),
        f"{layer}mlp.shared_expert_gate.weight": torch.randn(1, 64, generator=g),
        f"{layer}mlp.experts.gate_up_proj": torch.randn(4, 64, 64, generator=g),
        f"{layer}mlp.experts.down_proj": torch.randn(4, 64, 32, generator=g),
        "model.visual.blocks.0.attn.qkv.weight": torch.randn(96, 32, generator=g),
        "model.visual.blocks.0.mlp.linear_fc1.weight": torch.randn(64, 32, generator=g),
        "mtp.layers.0.self_attn.q_proj.weight": torch.randn(64, 64, generator=g),
        "mtp.layers.0.mlp.experts.gate_up_proj": torch.randn(4, 64, 64, generator=g),
        "mtp.fc.weight": torch.randn(64, 128, generator=g),
        "lm_head.weight": torch.randn(256, 64, generator=g),
    }
    save_file(weights, src / "model.safetensors")
    (src / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe",
                                                 "architectures": ["Qwen3_5MoeForConditionalGeneration"]}))
    after = tensors(convert(src, tmp_path / "out", CONFIG))
    for name in (f"{layer}self_attn.q_proj.weight", f"{layer}linear_attn.in_proj_qkv.weight",
                 f"{layer}mlp.experts.3.up_proj.weight", f"{layer}mlp.experts.0.down_proj.weight"):
        assert f"{name}_packed" in after and name not in after
    kept = [n for n in weights if n.startswith(("model.visual.", "mtp.")) or n.endswith(
        ("in_proj_a.weight", "mlp.gate.weight", "shared_expert_gate.weight", "embed_tokens.weight", "lm_head.weight"))]
    for name in kept:
        assert torch.equal(after[name], weights[name]), name
    assert not any(n.endswith("_packed") and n.startswith(("mtp.", "model.visual.")) for n in after)


def test_awq_scale_folds_into_zero_centred_norms():
    """Qwen3.5/3.6 norms compute x_hat * (1 + w): dividing their output by s means (1 + w) / s - 1."""
    from a3b_backend.quant.convert import fold_norm_scale

    x_hat, w, s = torch.randn(5, 8), torch.randn(8) * 0.1, torch.rand(8) + 0.5
    torch.testing.assert_close(x_hat * (1 + fold_norm_scale(w, s, zero_centred=True)), x_hat * (1 + w) / s)
    torch.testing.assert_close(x_hat * fold_norm_scale(w, s, zero_centred=False), x_hat * w / s)


@pytest.mark.parametrize("model_type, extra", [("qwen3_moe", dict(MOE, decoder_sparse_step=1)),
                                               ("qwen3_5_moe_text", QWEN35)])
def test_each_expert_gets_the_statistics_of_the_tokens_routed_to_it(tmp_path, tokenizer, model_type, extra):
    """gate/up: the tokens the router sent to that expert; down_proj: the expert's own act(gate) * up."""
    from transformers import AutoModelForCausalLM

    from a3b_backend.quant import calibrate

    model = AutoModelForCausalLM.from_pretrained(tiny(tmp_path, model_type, vocab_size=len(tokenizer), **extra),
                                                 dtype=torch.float32)
    ids = torch.tensor(tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 8)[:64])
    block = model.get_submodule("model.layers.1.mlp")
    inputs = []
    hook = block.register_forward_hook(lambda _m, args, _o: inputs.append(args[0].reshape(-1, args[0].shape[-1])))
    stats = calibrate.collect(model, ids, seq_len=32)
    hook.remove()
    x = torch.cat(inputs)
    assert stats["model.layers.1.mlp"].count == 64  # the block's input: every token
    _, _, chosen = block.gate(x)
    experts = block.experts
    for e in range(experts.gate_up_proj.shape[0]):
        routed = x[(chosen == e).any(-1)]
        if len(routed) == 0:
            assert f"model.layers.1.mlp.experts.{e}.gate_proj" not in stats
            continue
        own = stats[f"model.layers.1.mlp.experts.{e}.gate_proj"]
        assert own is stats[f"model.layers.1.mlp.experts.{e}.up_proj"] and own.count == len(routed)
        torch.testing.assert_close(own.importance, (routed ** 2).mean(0))
        gate, up = torch.nn.functional.linear(routed, experts.gate_up_proj[e]).chunk(2, dim=-1)
        torch.testing.assert_close(stats[f"model.layers.1.mlp.experts.{e}.down_proj"].importance,
                                   ((experts.act_fn(gate) * up) ** 2).mean(0))


def test_experts_with_too_few_tokens_fall_back_to_their_blocks_statistics_and_are_counted(tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM

    from a3b_backend.quant import calibrate

    model = AutoModelForCausalLM.from_pretrained(
        tiny(tmp_path, "qwen3_moe", vocab_size=len(tokenizer), **dict(MOE, decoder_sparse_step=1)),
        dtype=torch.float32)
    def never_expert_3(_router, _args, out):
        logits = out[0].clone()
        logits[:, 3] = float("-inf")
        weights, chosen = logits.softmax(-1).topk(MOE["num_experts_per_tok"], dim=-1)
        return logits, (weights / weights.sum(-1, keepdim=True)).to(out[1].dtype), chosen

    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(never_expert_3)
    stats = calibrate.collect(model, torch.tensor(tokenizer.encode("A lazy dog sleeps in the sun. " * 4)[:32]))
    assert "model.layers.0.mlp.experts.3.gate_proj" not in stats
    routed = sum(stats[f"model.layers.0.mlp.experts.{e}.down_proj"].count for e in range(3))
    fallbacks = calibrate.fill_expert_fallbacks(stats, model)
    starved = [(layer, e) for layer in (0, 1) for e in range(4)
               if stats[f"model.layers.{layer}.mlp.experts.{e}.gate_proj"] is stats[f"model.layers.{layer}.mlp"]]
    assert (0, 3) in starved and (1, 3) in starved and fallbacks == len(starved)
    # down_proj: every expert's intermediate activations of the block, pooled
    assert stats["model.layers.0.mlp.experts.3.down_proj"].count == routed == 32 * MOE["num_experts_per_tok"]


def test_names_resolve_between_the_published_layout_and_the_loaded_model():
    from a3b_backend.quant.names import PUBLISHED, TEXT_ONLY, LayoutError, layout_of

    published = ["model.language_model.layers.0.mlp.experts.gate_up_proj", "model.visual.blocks.0.attn.qkv.weight",
                 "mtp.layers.0.self_attn.q_proj.weight", "lm_head.weight"]
    assert layout_of(published) is PUBLISHED
    assert layout_of(["model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight"]) is TEXT_ONLY
    expert = "layers.3.mlp.experts.7.down_proj"
    assert PUBLISHED.module(f"model.language_model.{expert}") == f"model.{expert}"
    assert PUBLISHED.module("model.language_model.layers.3.input_layernorm") == "model.layers.3.input_layernorm"
    assert PUBLISHED.module("mtp.layers.0.self_attn.q_proj") is None
    assert PUBLISHED.module("model.visual.blocks.0.attn.qkv") is None
    assert PUBLISHED.module("lm_head") == "lm_head"
    assert PUBLISHED.checkpoint("model.layers.3.linear_attn.out_proj") == \
        "model.language_model.layers.3.linear_attn.out_proj"
    assert TEXT_ONLY.module("model.layers.3.mlp.down_proj") == TEXT_ONLY.checkpoint("model.layers.3.mlp.down_proj")
    with pytest.raises(LayoutError, match="no decoder layers found under any known layout.*transformer.h.0"):
        layout_of(["transformer.h.0.attn.c_attn.weight"])


def test_published_layout_calibrates_every_linear(tmp_path, tokenizer):
    """Qwen3.6's published layout (model.language_model.*, stacked experts, an MTP layer): transformers
    names its modules without language_model, and every linear still gets its statistics."""
    from a3b_backend.prepare.qwen_tiny import real_layout

    text_only = tiny(tmp_path, "qwen3_5_moe_text", vocab_size=len(tokenizer), **QWEN35)
    src = tmp_path / "published"
    src.mkdir()
    save_file(real_layout(tensors(text_only)), src / "model.safetensors", metadata={"format": "pt"})
    (src / "config.json").write_text((text_only / "config.json").read_text())
    tokenizer.save_pretrained(src)
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. A lazy dog sleeps in the sun all day. " * 30)
    plain = tensors(convert(src, tmp_path / "plain", CONFIG))
    calibrated_dir = convert_layers(src, tmp_path / "calibrated", CONFIG, text, 256, rounding="nearest")
    calibrated = tensors(calibrated_dir)
    quantization = json.loads((calibrated_dir / "config.json").read_text())["quantization_config"]
    assert quantization["calibrated"] is True and quantization["experts_on_fallback"] >= 0
    codes = [n for n in plain if n.endswith("_packed")]
    assert all(n.startswith("model.language_model.layers.") for n in codes)
    changed = [n for n in codes if not torch.equal(plain[n], calibrated[n])]
    assert len(changed) >= 0.9 * len(codes), sorted(set(codes) - set(changed))[:5]
    norm = "model.language_model.layers.1.input_layernorm.weight"  # the full-attention layer's q/k/v fold in
    assert not torch.equal(plain[norm], calibrated[norm])
    assert all(torch.equal(plain[n], calibrated[n]) for n in plain if n.startswith("mtp."))


def test_a_calibrated_conversion_refuses_a_linear_without_statistics():
    from a3b_backend.quant.convert import LinearCalibration, quantize_linear

    calibration = {"model.layers.0.self_attn.q_proj": LinearCalibration(torch.ones(64))}
    with pytest.raises(ConversionError, match=r"no statistics for the linear model\.language_model\.layers\.0\.self_"
                                              r"attn\.k_proj\.weight \(module model\.layers\.0\.self_attn\.k_proj"):
        quantize_linear("model.language_model.layers.0.self_attn.k_proj.weight", torch.randn(64, 64), CONFIG,
                        calibration, "model.layers.0.self_attn.k_proj")


def test_hessians_are_the_inputs_second_moments(tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM

    from a3b_backend.quant import calibrate

    model = AutoModelForCausalLM.from_pretrained(tiny(tmp_path, "llama", vocab_size=len(tokenizer)),
                                                 dtype=torch.float32)
    ids = torch.tensor(tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 8)[:64])
    stats = calibrate.collect(model, ids, seq_len=32, hessians=True)
    for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj"):
        st = stats[f"model.layers.1.{name}"]
        assert torch.allclose(st.hessian.diagonal(), st.importance, rtol=1e-5)
    q, v = stats["model.layers.0.self_attn.q_proj"], stats["model.layers.0.self_attn.v_proj"]
    assert torch.equal(q.gram, v.gram)  # one input, one x^T x


def test_broad_calibration_text_mixes_licences_package_readmes_and_docstring_prose(tmp_path, monkeypatch):
    import importlib.metadata

    from a3b_backend.quant import calibrate

    monkeypatch.setattr(calibrate, "LICENCE_TEXTS", tmp_path)
    (tmp_path / "Long-1.0").write_text("Licence opening. " + "x" * calibrate.DOCUMENT_CHARS + " LICENCE TAIL")
    (tmp_path / "Alias").symlink_to(tmp_path / "Long-1.0")
    text = calibrate.broad_calibration_text()
    assert text == calibrate.broad_calibration_text()  # a fixed order: every tool and every run reads the same
    assert text.count("Licence opening.") == 1  # an alias is not read twice
    assert "LICENCE TAIL" not in text  # each document cut to DOCUMENT_CHARS
    readme = importlib.metadata.metadata("tqdm").json["description"]
    assert readme[:200] in text
    assert calibrate.package_prose(importlib.metadata.distribution("click"), set())[:200] in text  # prose too
    assert not [p for p in calibrate.stdlib_prose() if p in text]  # the prose held-out register is never read


def test_package_prose_reads_docstring_paragraphs_but_not_tests_or_held_out_ones(tmp_path):
    import importlib.metadata

    from a3b_backend.quant import calibrate

    def paragraph(word: str) -> str:
        return " ".join([f"The {word} paragraph says what this does, in plain words."] * 5)

    (tmp_path / "pkg" / "tests").mkdir(parents=True)
    (tmp_path / "pkg" / "a.py").write_text(
        f'"""{paragraph("module")}\n\nshort"""\n\ndef f():\n    """{paragraph("held")}"""\n')
    (tmp_path / "pkg" / "b.py").write_text("def broken(:\n")
    (tmp_path / "pkg" / "tests" / "test_a.py").write_text(f'"""{paragraph("test")}"""\n')
    info = tmp_path / "pkg-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pkg\nVersion: 1.0\n")
    (info / "RECORD").write_text("pkg/a.py,,\npkg/b.py,,\npkg/tests/test_a.py,,\n")
    prose = calibrate.package_prose(importlib.metadata.PathDistribution(info), held_out={paragraph("held")})
    assert prose == paragraph("module")  # no short paragraph, no held-out one, no test's, no broken file's


def test_chat_calibration_text_renders_each_document_as_one_exchange(tmp_path, monkeypatch, tokenizer):
    from a3b_backend.quant import calibrate

    monkeypatch.setattr(calibrate, "broad_calibration_documents",
                        lambda: ["Title line\nThe body of it.\n\nMore body.", "one line only " * 30])
    text = calibrate.chat_calibration_text(tokenizer)
    first = tokenizer.apply_chat_template([{"role": "user", "content": "Title line"},
                                           {"role": "assistant", "content": "The body of it.\n\nMore body."}],
                                          tokenize=False)
    assert text.startswith(first)  # the first line asked, the rest answered, in the model's template
    assert text.count("<|im_start|>assistant\n") == 2
    ids = tokenizer.encode(text)
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") in ids  # the template's special tokens, as served


def test_the_config_records_which_calibration_text_ran(tmp_path, tokenizer):
    from a3b_backend.quant.convert import BUILT_IN_FILES

    src = tiny(tmp_path, "llama", vocab_size=len(tokenizer))
    tokenizer.save_pretrained(src)
    records = {}
    for flags in ([], ["--calibration-chat"]):
        dst = tmp_path / f"out{len(flags)}"
        assert main([str(src), str(dst), "--block-shape", "1", "32", "--cpu-only-blocks", "--calibration-tokens", "256",
                     "--tune-epochs", "0", *flags]) == 0
        records[bool(flags)] = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert records[False]["calibration_text"] == BUILT_IN_FILES["plain"]
    assert records[True]["calibration_text"] == BUILT_IN_FILES["chat"]
    assert records[True]["calibration_text_sha256"] != records[False]["calibration_text_sha256"]


def test_chat_calibration_is_refused_with_a_text_of_ones_own(tmp_path, capsys):

    src = tiny(tmp_path, "llama")
    (tmp_path / "text.txt").write_text("some text " * 100)
    assert main([str(src), str(tmp_path / "out"), "--calibration-chat", "--calibration-text",
                 str(tmp_path / "text.txt")]) == 2
    assert "--calibration-chat renders the built-in text; it cannot take --calibration-text" in capsys.readouterr().err


@pytest.mark.parametrize("block, runs", [((1, 128), True), ((1, 256), True), ((1, 64), False), ((4, 128), False),
                                         ((1, 192), False)])
def test_block_shapes_the_gpu_kernels_cannot_run_are_named(block, runs):
    from a3b_backend.quant.format import gpu_block_problem

    assert (gpu_block_problem(block) is None) == runs


def test_the_converter_refuses_a_block_shape_the_gpu_cannot_run_unless_asked(tmp_path, capsys):

    src = tiny(tmp_path, "llama")
    assert main([str(src), str(tmp_path / "out"), "--block-shape", "1", "32", "--uncalibrated"]) == 2
    assert "power of two >= 128" in capsys.readouterr().err and not (tmp_path / "out").exists()
    assert main([str(src), str(tmp_path / "out"), "--block-shape", "1", "32", "--uncalibrated",
                 "--cpu-only-blocks"]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["block_shape"] == [1, 32]
