"""Layer-sequential conversion (a3b_backend/quant/sequential.py) on tiny random checkpoints: the
layer runner's statistics against the whole model's, the checkpoint it writes, resuming, refusals."""
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_quant_convert import CONFIG, QWEN35, tensors, tiny

from a3b_backend.prepare.qwen_tiny import real_layout
from a3b_backend.quant.checkpoint import INPUT_SCALES_FILE
from a3b_backend.profiles import PROJECT_ROOT
from a3b_backend.quant import calibrate, sequential, stream_tune
from a3b_backend.quant.dequantized import float_model
from a3b_backend.quant.convert import ConversionError, convert, main
from a3b_backend.quant.block_tune import BlockTuneConfig, held_out_windows
from a3b_backend.quant.tune import TuneConfig

sys.path.insert(0, str(PROJECT_ROOT / "perf"))
import qwen_fidelity  # noqa: E402  (its outlier channels, as make bench-qwen-fidelity adds them)

TEXT = "The quick brown fox jumps over the lazy dog. A lazy dog sleeps in the sun all day. " * 60


@pytest.fixture
def text(tmp_path) -> Path:
    path = tmp_path / "calib.txt"
    path.write_text(TEXT)
    return path


@pytest.fixture
def windows_16(tmp_path) -> Path:
    """A calibration text of 16 windows (the fewest that hold some out of training)."""
    path = tmp_path / "calib-16.txt"
    path.write_text(TEXT * 7)
    return path


def checkpoint(tmp_path: Path, tokenizer, model_type: str, extra: dict, published: bool = False) -> Path:
    src = tiny(tmp_path, model_type, vocab_size=len(tokenizer), **extra)
    if published:  # Qwen3.6's released layout: model.language_model.*, stacked experts, an MTP layer
        out = tmp_path / "published"
        out.mkdir()
        save_file(real_layout(tensors(src)), out / "model.safetensors", metadata={"format": "pt"})
        (out / "config.json").write_text((src / "config.json").read_text())
        src = out
    tokenizer.save_pretrained(src)
    return src


@pytest.mark.parametrize("model_type, extra", [("llama", {}), ("qwen3_5_moe_text", QWEN35)])
def test_layer_by_layer_statistics_equal_the_whole_models(tmp_path, tokenizer, text, model_type, extra):
    """With float outputs passed on, each layer sees exactly what it sees inside the whole model."""
    from transformers import AutoModelForCausalLM

    src = checkpoint(tmp_path, tokenizer, model_type, extra)
    windows = sequential.windows_of(src, text, 2 * sequential.SEQ_LEN)
    whole = calibrate.collect(AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval(),
                              torch.cat(windows), seq_len=sequential.SEQ_LEN)
    source = sequential.Source.open(src)
    hidden, calls, layers = sequential.layer_inputs(sequential.skeleton(src), source, windows)
    by_layer = {}
    for index, meta_layer in enumerate(layers):
        layer, _ = sequential.load_layer(meta_layer, source, index)
        by_layer.update(calibrate.record(layer, lambda: sequential.run_layer(layer, hidden, calls[index]),
                                         prefix=f"model.layers.{index}."))
        hidden = sequential.run_layer(layer, hidden, calls[index])
    assert set(by_layer) == set(whole)
    for name, st in whole.items():
        assert by_layer[name].count == st.count, name
        torch.testing.assert_close(by_layer[name].importance, st.importance, rtol=1e-5, atol=1e-7)


def test_layer_pipeline_writes_a_checkpoint_that_computes_what_the_source_does(tmp_path, tokenizer, text):
    from transformers import AutoModelForCausalLM

    src = checkpoint(tmp_path, tokenizer, "qwen3_5_moe_text", QWEN35, published=True)
    dst = sequential.convert_layers(src, tmp_path / "layers", CONFIG, text, 512, rounding="nearest",
                                    tune_config=BlockTuneConfig(steps=0))
    quantization = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert quantization["calibrated"] is True and quantization["pipeline"] == "layers"
    assert quantization["calibration_text_sha256"] == hashlib.sha256(TEXT.encode()).hexdigest()
    got = tensors(dst)
    plain = tensors(convert(src, tmp_path / "plain", CONFIG))
    assert set(got) == set(plain)  # the same tensors, names and layout as the uncalibrated conversion
    assert not (dst / sequential.PROGRESS).exists() and not (dst / sequential.ACTIVATIONS).exists()
    # the dequantizing loader reads it
    text_only = tmp_path / "qwen3_5_moe_text"
    ids = torch.tensor([tokenizer.encode("A lazy dog sleeps in the sun all day.")])
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(text_only, dtype=torch.float32)(ids).logits
        renamed = tmp_path / "layers-text-only"
        renamed.mkdir()
        save_file({n.replace("model.language_model.", "model.", 1): t for n, t in got.items()
                   if not n.startswith("mtp.")}, renamed / "model.safetensors")
        (renamed / "config.json").write_text((dst / "config.json").read_text())
        relative = float((float_model(renamed)(ids).logits - ref).norm() / ref.norm())
    assert relative < 0.2


def test_block_wise_tuning_brings_the_output_closer_to_the_source(tmp_path, tokenizer, text):
    """Each layer's dense linears' rounding and metadata tuned against the layer's float output on a
    model with outlier channels: stored codes change, the held-out block loss falls, the whole
    model's error falls, and the config says what ran."""
    src = qwen_fidelity.with_outliers(checkpoint(tmp_path, tokenizer, "qwen3_5_moe_text", QWEN35, published=True),
                                      tmp_path / "outliers")
    ids = torch.tensor([tokenizer.encode(TEXT[:600])])
    with torch.no_grad():
        reference = float_model(src)(ids).logits
    errors, codes = {}, {}
    for steps in (0, 30):
        dst = sequential.convert_layers(src, tmp_path / f"tuned-{steps}", CONFIG, text, 1024, rounding="nearest",
                                        tune_config=BlockTuneConfig(steps=steps, batch=2, evaluate_every=5))
        quantization = json.loads((dst / "config.json").read_text())["quantization_config"]
        assert ("tuning" in quantization) == (steps > 0)
        per_layer = json.loads((dst / sequential.REPORT).read_text())["per_layer"]
        assert all(isinstance(layer["tuning"], float) for layer in per_layer)  # seconds, as bench-convert-scale reads
        assert all(("block_tuning" in layer) == (steps > 0) for layer in per_layer)
        with torch.no_grad():
            errors[steps] = float((float_model(dst)(ids).logits - reference).norm() / reference.norm())
        codes[steps] = {n: t for n, t in tensors(dst).items() if n.endswith("_packed") and ".experts." not in n}
    tuning = quantization["tuning"]
    assert tuning["steps"] == 30 and tuning["method"] == "block-wise" and len(tuning["held_out_loss"]) == 2
    assert all(after <= before for before, after in tuning["held_out_loss"])
    assert tuning["held_out_loss"][0][1] < 0.9 * tuning["held_out_loss"][0][0], tuning
    assert tuning["layers_kept_untuned"] == sum(step == 0 for step in tuning["best_step"])
    assert errors[30] < 0.95 * errors[0], errors
    assert any(not torch.equal(codes[30][n], codes[0][n]) for n in codes[0])


def test_an_interrupted_conversion_resumes_from_the_next_layer(tmp_path, tokenizer, text, monkeypatch, capsys):
    """A tuned conversion on quantized inputs (two chains of hidden states to resume from) resumes
    to the same bytes as an uninterrupted one."""
    src = checkpoint(tmp_path, tokenizer, "llama", {})
    tuning = BlockTuneConfig(steps=6, batch=1, evaluate_every=2, inputs="quantized")
    reference = tensors(sequential.convert_layers(src, tmp_path / "reference", CONFIG, text, 1024, "nearest",
                                                  tune_config=tuning))
    original = sequential.quantize_layer

    def crash_at_layer_1(layer, index, *args, **kwargs):
        if index == 1:
            raise KeyboardInterrupt
        return original(layer, index, *args, **kwargs)

    monkeypatch.setattr(sequential, "quantize_layer", crash_at_layer_1)
    with pytest.raises(KeyboardInterrupt):
        sequential.convert_layers(src, tmp_path / "out", CONFIG, text, 1024, "nearest", tune_config=tuning)
    assert not (tmp_path / "out").exists()
    assert json.loads((tmp_path / "out.partial" / sequential.PROGRESS).read_text())["layers_done"] == 1
    monkeypatch.setattr(sequential, "quantize_layer", original)
    calls = []
    monkeypatch.setattr(sequential, "load_layer", lambda layer, source, index: calls.append(index) or
                        original_load(layer, source, index))
    capsys.readouterr()
    resumed = tensors(sequential.convert_layers(src, tmp_path / "out", CONFIG, text, 1024, "nearest",
                                                tune_config=tuning))
    assert "resuming" in capsys.readouterr().out and calls == [1]
    assert set(resumed) == set(reference) and all(torch.equal(resumed[n], reference[n]) for n in reference)


original_load = sequential.load_layer


def _kl(reference: torch.Tensor, logits: torch.Tensor) -> float:
    return float(torch.nn.functional.kl_div(logits.log_softmax(-1), reference.log_softmax(-1), log_target=True,
                                            reduction="batchmean"))


@pytest.mark.parametrize("model_type, extra", [("llama", {}), ("qwen3_5_moe_text", QWEN35)])
def test_end_to_end_tuning_layer_by_layer_brings_the_model_closer_to_the_source(tmp_path, tokenizer, windows_16,
                                                                                model_type, extra):
    """--tune-epochs on the layer pipeline, on a model with outlier channels: the stored metadata
    and norms change (the 4-bit codes stay), the held-out KL falls and the config says so with the
    windows its time went to, and the checkpoint written is the tuned one: read back, it is nearer
    the source on a held-out window."""
    src = qwen_fidelity.with_outliers(checkpoint(tmp_path, tokenizer, model_type, extra,
                                                 published=model_type != "llama"), tmp_path / "outliers")
    windows = sequential.windows_of(src, windows_16, 16 * sequential.SEQ_LEN)
    ids = windows[held_out_windows(len(windows))[0]].unsqueeze(0)
    with torch.no_grad():
        reference = float_model(src)(ids).logits
    kl, stored = {}, {}
    for epochs in (0, 2):
        dst = sequential.convert_layers(src, tmp_path / f"tuned-{epochs}", CONFIG, windows_16, 16 * sequential.SEQ_LEN,
                                        rounding="nearest", end_to_end=TuneConfig(epochs=epochs, lr=1e-2))
        quantization = json.loads((dst / "config.json").read_text())["quantization_config"]
        with torch.no_grad():
            kl[epochs] = _kl(reference, float_model(dst)(ids).logits)
        stored[epochs] = tensors(dst)
    assert quantization["tuned_epochs"] == 2
    record = quantization["end_to_end_tuning"]
    before, after = record["held_out_kl"]
    assert record["best_step"] > 0 and after < 0.9 * before, record
    layers = json.loads((dst / "config.json").read_text())["num_hidden_layers"]
    timing, evaluations = record["timing"], len(record["history"])  # where the time went
    assert timing["train_windows"] == record["steps"] and timing["train_builds"] == 2 * record["steps"] * layers
    assert timing["evaluation_windows"] == evaluations * len(held_out_windows(len(windows)))
    assert timing["evaluation_builds"] == evaluations * layers
    assert timing["train_s"] > timing["train_build_s"] + timing["train_head_s"] > 0
    assert kl[2] < kl[0], kl
    changed = {n for n in stored[0] if not torch.equal(stored[0][n], stored[2][n])}
    assert not any(n.endswith("_packed") for n in changed)
    assert any(n.endswith("_lo_scale") for n in changed) and any("layernorm.weight" in n for n in changed), changed
    scales = load_file(dst / INPUT_SCALES_FILE)  # a tuned norm's other readers record its scale as tuned too
    for reader in (m for m in scales if calibrate.reads_folded_norm(m)):
        member = next(m for m in scales
                      if calibrate.FOLDABLE.search(m) and calibrate.norm_for(m) == calibrate.norm_for(reader))
        torch.testing.assert_close(scales[reader], scales[member], rtol=0, atol=0)


def test_every_reader_of_a_folded_norm_takes_its_scale(tmp_path, tokenizer, text):
    """Gated DeltaNet's and a MoE block's norms fold the AWQ scale searched on their quantized
    readers (in_proj_qkv/z, the shared expert's gate/up); the norm's other readers take it into
    their input columns too (the router, the shared expert's gate and the a/b projections as
    stored, the routed experts before rounding) and record it for the LoRA fold, so that what the
    unquantized readers compute is the source's."""
    src = qwen_fidelity.with_outliers(checkpoint(tmp_path, tokenizer, "qwen3_5_moe_text", QWEN35),
                                      tmp_path / "outliers")
    dst = sequential.convert_layers(src, tmp_path / "a3b", CONFIG, text, 1024, tune_config=BlockTuneConfig(steps=0))
    source, stored, scales = tensors(src), tensors(dst), load_file(dst / INPUT_SCALES_FILE)
    x_hat = torch.randn(5, source["model.layers.0.input_layernorm.weight"].numel())
    readers = {"input_layernorm": ("linear_attn.in_proj_qkv", ["linear_attn.in_proj_a", "linear_attn.in_proj_b"]),
               "post_attention_layernorm": ("mlp.shared_expert.gate_proj", ["mlp.gate", "mlp.shared_expert_gate"])}
    folded = 0
    for layer in range(2):
        for norm, (member, unquantized) in readers.items():
            prefix = f"model.layers.{layer}."
            if prefix + member not in scales:  # layer 1's input norm feeds attention, folded as before
                continue
            scale = scales[prefix + member]
            folded += not torch.allclose(scale, torch.ones_like(scale))
            assert torch.equal(scales[prefix + "mlp.experts"] if norm.startswith("post") else scale, scale)
            source_norm, stored_norm = 1 + source[f"{prefix}{norm}.weight"], 1 + stored[f"{prefix}{norm}.weight"]
            for reader in unquantized:
                assert torch.equal(scales[prefix + reader], scale), reader
                torch.testing.assert_close((x_hat * stored_norm) @ stored[f"{prefix}{reader}.weight"].T,
                                           (x_hat * source_norm) @ source[f"{prefix}{reader}.weight"].T)
    assert folded >= 2  # the outlier channels gave the scales something to do


def test_the_heads_kl_in_chunks_of_tokens_equals_it_whole(monkeypatch):
    """A window's KL at the head taken a few tokens at a time (as at Qwen3.6's vocabulary), and
    its gradient, equal the KL taken over the whole window at once."""
    torch.manual_seed(0)
    hidden_size, vocab, tokens = 16, 50, 13
    head = stream_tune.Head(torch.nn.RMSNorm(hidden_size), torch.nn.Linear(hidden_size, vocab, bias=False))
    hidden, teacher = torch.randn(1, tokens, hidden_size), torch.randn(1, tokens, hidden_size)
    found = {}
    for logits in (vocab * tokens, vocab * 4):
        monkeypatch.setattr(stream_tune, "HEAD_LOGITS", logits)
        student = hidden.clone().requires_grad_(True)
        found[len(head.chunks(tokens))] = stream_tune.head_kl(head, student, teacher, backward=True), student.grad
    (kl, grad), (chunked_kl, chunked_grad) = found[1], found[4]
    assert kl == pytest.approx(chunked_kl, rel=1e-5) and kl > 0
    torch.testing.assert_close(chunked_grad, grad)


def test_the_heads_logits_from_a_bf16_lm_head_a_few_rows_at_a_time_equal_a_float32_linears(monkeypatch):
    """lm_head's weight kept as stored (bf16), made float32 a few vocabulary rows at a time: the
    logits and their gradient equal a float32 linear's of the same weights."""
    torch.manual_seed(0)
    monkeypatch.setattr(stream_tune, "HEAD_ROWS", 7)
    linear = torch.nn.Linear(16, 50, bias=False)
    linear.weight.data = linear.weight.data.bfloat16().float()
    stored = torch.nn.Linear(16, 50, bias=False, dtype=torch.bfloat16)
    stored.weight.data = linear.weight.data.bfloat16()
    found, upstream = [], torch.randn(1, 13, 50)
    for logits_of in (linear, stream_tune.Head(torch.nn.Identity(), stored)):
        x = torch.randn(1, 13, 16, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
        logits = logits_of(x)
        logits.backward(upstream)
        found.append((logits.detach(), x.grad))
    (expected, expected_grad), (logits, grad) = found
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected)
    torch.testing.assert_close(grad, expected_grad)


def test_an_end_to_end_tuning_that_never_beats_its_start_keeps_the_untuned_checkpoint(tmp_path, tokenizer,
                                                                                        windows_16):
    """A rate far too large for the row scales never lowers the held-out KL: the config says the
    untuned conversion was kept, and the checkpoint is that conversion's, byte for byte."""
    src = checkpoint(tmp_path, tokenizer, "llama", {})
    untuned = tensors(sequential.convert_layers(src, tmp_path / "untuned", CONFIG, windows_16,
                                                16 * sequential.SEQ_LEN, "nearest"))
    dst = sequential.convert_layers(src, tmp_path / "kept", CONFIG, windows_16, 16 * sequential.SEQ_LEN, "nearest",
                                    end_to_end=TuneConfig(epochs=1, lr=50.0, block_codes_lr=0.0))
    record = json.loads((dst / "config.json").read_text())["quantization_config"]["end_to_end_tuning"]
    assert record["kept_untuned"] and record["best_step"] == 0
    assert record["held_out_kl"][1] == record["held_out_kl"][0]
    kept = tensors(dst)
    assert set(kept) == set(untuned) and all(torch.equal(kept[n], untuned[n]) for n in untuned)


def test_an_interrupted_end_to_end_tuning_resumes_to_the_same_bytes(tmp_path, tokenizer, windows_16, monkeypatch,
                                                                    capsys):
    text = windows_16
    src = checkpoint(tmp_path, tokenizer, "llama", {})
    tuning = TuneConfig(epochs=1, lr=1e-2)
    reference = tensors(sequential.convert_layers(src, tmp_path / "reference", CONFIG, text,
                                                  16 * sequential.SEQ_LEN, "nearest", end_to_end=tuning))
    original = sequential.stream_tune.ConvertedLayers.build
    built = []

    def crash_after_the_first_evaluations(self, index):
        built.append(index)
        # 2 layers built: for their trainables, for the first evaluation (once for both held-out windows),
        # twice for each of the 3 training steps before the second evaluation, and once for it: then a crash
        if len(built) > 2 + 2 + 3 * 4 + 2:
            raise KeyboardInterrupt
        return original(self, index)

    monkeypatch.setattr(sequential.stream_tune.ConvertedLayers, "build", crash_after_the_first_evaluations)
    with pytest.raises(KeyboardInterrupt):
        sequential.convert_layers(src, tmp_path / "out", CONFIG, text, 16 * sequential.SEQ_LEN, "nearest",
                                  end_to_end=tuning)
    state = torch.load(tmp_path / "out.partial" / sequential.stream_tune.STATE)
    assert 0 < state["step"] < 14
    monkeypatch.setattr(sequential.stream_tune.ConvertedLayers, "build", original)
    capsys.readouterr()
    resumed = tensors(sequential.convert_layers(src, tmp_path / "out", CONFIG, text, 16 * sequential.SEQ_LEN,
                                                "nearest", end_to_end=tuning))
    assert f"resuming the end-to-end tuning at step {state['step']}" in capsys.readouterr().out
    assert set(resumed) == set(reference) and all(torch.equal(resumed[n], reference[n]) for n in reference)


def test_refusals(tmp_path, tokenizer, text):
    src = checkpoint(tmp_path, tokenizer, "llama", {})
    with pytest.raises(ConversionError, match=r"calib.txt is \d+ tokens; --calibration-tokens asks for 100000"):
        sequential.convert_layers(src, tmp_path / "out", CONFIG, text, 100000)
    broken = tmp_path / "broken"
    broken.mkdir()
    kept = {n: t for n, t in tensors(src).items() if n != "model.layers.1.mlp.down_proj.weight"}
    save_file(kept, broken / "model.safetensors")
    (broken / "config.json").write_text((src / "config.json").read_text())
    tokenizer.save_pretrained(broken)
    with pytest.raises(ConversionError, match=r"layer 1 has no tensor for model\.layers\.1\.mlp\.down_proj"):
        sequential.convert_layers(broken, tmp_path / "out2", CONFIG, text, 512, "nearest")
    assert not (tmp_path / "out2").exists()


@pytest.mark.parametrize("options, named", [
    (["--tune-epochs", "-1"], "--tune-epochs -1: allowed are 0"),
    (["--tune-steps", "-1"], "--tune-steps -1: allowed are 0"),
    (["--pipeline", "layers", "--tune-inputs", "float"], "--tune-inputs float chooses what --tune-steps N tunes on"),
])
def test_bad_tuning_options_are_refused_naming_them(tmp_path, tokenizer, text, capsys, options,
                                                                      named):
    src = checkpoint(tmp_path, tokenizer, "llama", {})
    assert main([str(src), str(tmp_path / "refused"), "--calibration-text", str(text), *options]) == 2
    assert named in capsys.readouterr().err and not (tmp_path / "refused").exists()


def test_experts_calibrated_on_every_token_say_so_and_round_otherwise(tmp_path, tokenizer, text):
    """--expert-tokens all: no expert falls back, the config records it, the experts' codes differ
    from the routed conversion's."""
    src = checkpoint(tmp_path, tokenizer, "qwen3_5_moe_text", QWEN35, published=True)
    routed = sequential.convert_layers(src, tmp_path / "routed", CONFIG, text, 512, rounding="nearest")
    every = sequential.convert_layers(src, tmp_path / "every", CONFIG, text, 512, rounding="nearest",
                                      every_expert=True)
    quantization = json.loads((every / "config.json").read_text())["quantization_config"]
    assert quantization["expert_statistics"] == "every token" and quantization["experts_on_fallback"] == 0
    assert "expert_statistics" not in json.loads((routed / "config.json").read_text())["quantization_config"]
    got, base = tensors(every), tensors(routed)
    expert_codes = [n for n in got if ".experts." in n and n.endswith("_packed")]
    assert expert_codes and any(not torch.equal(got[n], base[n]) for n in expert_codes)


def test_a_device_this_host_lacks_is_refused_naming_it(tmp_path, tokenizer, text):
    src = checkpoint(tmp_path, tokenizer, "llama", {})
    with pytest.raises(ConversionError, match=r"--device 'tpu': allowed are cpu \(the default\) and cuda or cuda:N"):
        sequential.convert_layers(src, tmp_path / "out", CONFIG, text, 512, "nearest", device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConversionError, match=r"--device cuda: torch .* sees no CUDA GPU on this host"):
            sequential.convert_layers(src, tmp_path / "out", CONFIG, text, 512, "nearest", device="cuda")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="--device cuda needs a CUDA GPU")
def test_a_conversion_on_the_gpu_computes_what_the_cpus_does(tmp_path, tokenizer, text):
    """Each layer calibrated and rounded (error-compensating, experts on their own tokens) on the GPU:
    the same tensors, and a model as close to its source as the CPU's conversion (float sums differ
    between the devices, so a few codes may too)."""
    src = checkpoint(tmp_path, tokenizer, "qwen3_5_moe_text", QWEN35)
    on = {device: sequential.convert_layers(src, tmp_path / device, CONFIG, text, 1024, device=device)
          for device in ("cpu", "cuda")}
    assert set(tensors(on["cuda"])) == set(tensors(on["cpu"]))
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([tokenizer.encode("A lazy dog sleeps in the sun all day.")])
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)(ids).logits
        error = {d: float((float_model(dst)(ids).logits - ref).norm() / ref.norm()) for d, dst in on.items()}
    assert error["cuda"] < 1.2 * error["cpu"] + 1e-3, error


def test_too_little_disk_is_refused_before_anything_runs(tmp_path, tokenizer, text, monkeypatch):
    import types

    src = checkpoint(tmp_path, tokenizer, "llama", {})
    monkeypatch.setattr(sequential.os, "statvfs", lambda _path: types.SimpleNamespace(f_bavail=1, f_frsize=4096))
    with pytest.raises(ConversionError, match=r"GiB free; the conversion of .* needs up to"):
        sequential.convert_layers(src, tmp_path / "out", CONFIG, text, 512, "nearest")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_the_rest_is_written_in_bounded_groups(tmp_path, tokenizer):
    source = sequential.Source.open(checkpoint(tmp_path, tokenizer, "llama", {}))
    rest = source.by_layer[None]
    assert sorted(rest) == ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]
    assert sequential.rest_groups(source) == [sorted(rest, key=source.nbytes)]  # all of it under 1 GiB
    embedding = source.nbytes("model.embed_tokens.weight")
    assert embedding == source.read("model.embed_tokens.weight").nbytes
    assert sequential.rest_groups(source, limit=embedding) == [["model.norm.weight"], ["lm_head.weight"],
                                                              ["model.embed_tokens.weight"]]


def test_a_conversions_peak_memory_is_its_own_not_its_parents():
    """A conversion started by a process that once held more reports its own peak (getrusage's
    ru_maxrss would carry the parent's over execve)."""
    held = torch.ones(2**28)  # 1 GiB, touched
    assert sequential.peak_rss_gib() >= 1.0
    del held
    child = subprocess.run([sys.executable, "-c", "from a3b_backend.quant.sequential import peak_rss_gib; "
                            "print(peak_rss_gib())"], capture_output=True, text=True, check=True)
    assert float(child.stdout) < 0.9
