"""End-to-end metadata tuning: the trainable layer computes the stored weight, and tuning
moves only the metadata and norms, towards the source model's outputs."""

import pytest
import torch

from a3b_backend.quant import calibrate
from a3b_backend.quant.format import KINDS, A3BConfig, dequantize, quantize
from a3b_backend.quant.tune import NormGain, TunedLinear, TuneConfig, tune


@pytest.mark.parametrize("config", [A3BConfig(1, 32, iterations=2), A3BConfig(4, 32, iterations=2)],
                         ids=lambda c: f"{c.block_rows}x{c.block_cols}")
def test_untuned_layer_computes_and_stores_the_stored_weight(config):
    q = quantize(torch.randn(37, 70) * 0.05, config)
    x = torch.randn(5, 70)
    layer = TunedLinear(q, config, block_codes=True)
    torch.testing.assert_close(layer(x), x @ dequantize(q, config).T, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(getattr(layer.stored(q), kind), getattr(q, kind)) for kind in KINDS)


def _kl(teacher, student, ids) -> float:
    with torch.no_grad():
        target = teacher(ids).logits.log_softmax(-1)
        predicted = student(ids).logits.log_softmax(-1)
    return torch.nn.functional.kl_div(predicted, target, log_target=True, reduction="sum").item() / ids.numel()


def test_tuning_moves_only_the_metadata_and_norms_towards_the_source(tokenizer):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=len(tokenizer))
    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_config(cfg).eval()
    student = AutoModelForCausalLM.from_config(cfg).eval()
    student.load_state_dict(teacher.state_dict())
    config = A3BConfig(1, 32, iterations=2)
    weights = {name: quantize(m.weight.detach(), config) for name, m in calibrate.quantized_linears(teacher).items()}
    norms = tuple(calibrate.groups(list(weights)))
    ids = torch.tensor(tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 20)[:128])
    tuned = tune(teacher, student, weights, config, ids,
                 TuneConfig(epochs=10, lr=1e-2, block_codes_lr=0.3, seq_len=32), norms)
    for name, w in tuned.weights.items():
        assert torch.equal(w.packed, weights[name].packed)  # the 4-bit codes stay
        assert all(getattr(w, kind).dtype == getattr(weights[name], kind).dtype for kind in KINDS)
    for kind in ("lo", "step", "delta", "step_scale"):
        assert any(not torch.equal(getattr(w, kind), getattr(weights[n], kind)) for n, w in tuned.weights.items())
    assert set(tuned.norm_gains) == set(norms)
    assert any(not torch.equal(gain, torch.ones_like(gain)) for gain in tuned.norm_gains.values())
    # the student as the checkpoint will hold it: before and after tuning
    before = AutoModelForCausalLM.from_config(cfg).eval()
    before.load_state_dict(teacher.state_dict())
    after = AutoModelForCausalLM.from_config(cfg).eval()
    after.load_state_dict(teacher.state_dict())
    with torch.no_grad():
        for name in weights:
            before.get_submodule(name).weight.copy_(dequantize(weights[name], config))
            after.get_submodule(name).weight.copy_(dequantize(tuned.weights[name], config))
        for norm, gain in tuned.norm_gains.items():
            after.get_submodule(norm).weight.mul_(gain)
    assert _kl(teacher, after, ids.unsqueeze(0)) < 0.5 * _kl(teacher, before, ids.unsqueeze(0))


def test_norm_gain_scales_a_zero_centred_norms_output():
    weight = torch.randn(8)
    gain = NormGain(8, zero_centred=True)
    with torch.no_grad():
        gain.log_gain.copy_(torch.randn(8))
    torch.testing.assert_close(1 + gain(weight), (1 + weight) * gain.log_gain.exp())
