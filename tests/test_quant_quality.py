"""The quality report's variants: which linears they quantize and with which block shape."""
import torch

from a3b_backend.quant import calibrate
from a3b_backend.quant.format import A3BConfig, quantize
from a3b_backend.quant.quality import Variant, _a3b, apply_variant
from tests.test_quant_convert import tiny


def _unchanged(_name, w, _importance):
    """A stand-in quantizer that keeps the weight: what is left is the AWQ folding."""
    return w.clone(), w.numel()


@torch.no_grad()
def test_a_projection_alone_leaves_the_rest_computing_the_source(tmp_path, monkeypatch):
    """v_proj alone gets an AWQ scale folded into input_layernorm, which q/k read too:
    they must keep their source weights times that scale, so the model computes what it did."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(calibrate, "ALPHAS", (0.5,))  # a lossless quantizer would choose alpha 0, no scale

    model = AutoModelForCausalLM.from_pretrained(tiny(tmp_path, "llama"), dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (64,))
    before = model(ids.unsqueeze(0)).logits
    stats = calibrate.collect(model, ids, seq_len=32)
    linears = calibrate.quantized_linears(model)
    originals = {n: m.weight.detach().clone() for n, m in linears.items()}
    result = apply_variant(model, originals, stats, Variant("v only", "test", True, _unchanged, r"\.v_proj$"),
                           torch.float32)
    assert result["quantized_bytes"] == sum(w.numel() for n, w in originals.items() if n.endswith(".v_proj"))
    assert not torch.equal(model.model.layers[0].input_layernorm.weight, torch.ones(64))  # a scale was folded
    torch.testing.assert_close(model(ids.unsqueeze(0)).logits, before, rtol=1e-4, atol=1e-4)


def test_mixed_blocks_pick_each_linears_block():
    run = _a3b(A3BConfig(1, 128, iterations=1), ((r"down_proj$", (1, 32)),))
    w = torch.randn(16, 256)
    for name, block in (("model.layers.0.mlp.down_proj", (1, 32)), ("model.layers.0.self_attn.q_proj", (1, 128))):
        _, nbytes = run(name, w, None)
        assert nbytes == quantize(w, A3BConfig(*block, iterations=1)).nbytes()
