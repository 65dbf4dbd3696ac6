"""End-to-end row-scale tuning: the trainable layer computes the stored weight, and tuning
moves only the scales, towards the source model's outputs."""

import pytest
import torch

from a3b_backend.quant import calibrate
from a3b_backend.quant.format import KINDS, A3BConfig, dequantize, quantize
from a3b_backend.quant.tune import RowScaledLinear, TuneConfig, tune_scales


@pytest.mark.parametrize("config", [A3BConfig(1, 32, iterations=2), A3BConfig(4, 32, iterations=2)],
                         ids=lambda c: f"{c.block_rows}x{c.block_cols}")
def test_untuned_layer_computes_the_stored_weight(config):
    q = quantize(torch.randn(37, 70) * 0.05, config)
    x = torch.randn(5, 70)
    torch.testing.assert_close(RowScaledLinear(q, config)(x), x @ dequantize(q, config).T, rtol=1e-5, atol=1e-6)


def _kl(teacher, student, ids) -> float:
    with torch.no_grad():
        target = teacher(ids).logits.log_softmax(-1)
        predicted = student(ids).logits.log_softmax(-1)
    return torch.nn.functional.kl_div(predicted, target, log_target=True, reduction="sum").item() / ids.numel()


def test_tuning_moves_only_the_scales_towards_the_source(tokenizer):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=len(tokenizer))
    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_config(cfg).eval()
    student = AutoModelForCausalLM.from_config(cfg).eval()
    student.load_state_dict(teacher.state_dict())
    config = A3BConfig(1, 32, iterations=2)
    weights = {name: quantize(m.weight.detach(), config) for name, m in calibrate.quantized_linears(teacher).items()}
    ids = torch.tensor(tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 20)[:128])
    tuned = tune_scales(teacher, student, weights, config, ids, TuneConfig(epochs=10, lr=1e-2, seq_len=32))
    for name, w in tuned.items():
        for kind in set(KINDS) - {"lo_scale", "step_scale"}:
            assert torch.equal(getattr(w, kind), getattr(weights[name], kind))
        assert w.lo_scale.dtype == w.step_scale.dtype == torch.bfloat16
    assert any(not torch.equal(w.step_scale, weights[n].step_scale) for n, w in tuned.items())
    # the student as the checkpoint will hold it: before and after tuning
    before = AutoModelForCausalLM.from_config(cfg).eval()
    before.load_state_dict(teacher.state_dict())
    after = AutoModelForCausalLM.from_config(cfg).eval()
    after.load_state_dict(teacher.state_dict())
    with torch.no_grad():
        for name in weights:
            before.get_submodule(name).weight.copy_(dequantize(weights[name], config))
            after.get_submodule(name).weight.copy_(dequantize(tuned[name], config))
    assert _kl(teacher, after, ids.unsqueeze(0)) < 0.5 * _kl(teacher, before, ids.unsqueeze(0))
