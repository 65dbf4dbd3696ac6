"""Routed experts in the layer pipeline (a3b_backend/quant/experts.py): the routing recorded is the
model's, and each expert is rounded on its own tokens, error-compensating where it saw enough."""
import torch
from test_quant_convert import QWEN35

from a3b_backend.quant import calibrate
from a3b_backend.quant.experts import compensating_tokens, round_experts
from a3b_backend.quant.format import KINDS, A3BConfig, dequantize, quantize
from a3b_backend.quant.gptq import quantize_gptq

CONFIG = A3BConfig(1, 32, iterations=2)


def moe_block(seed: int = 0):
    from transformers import AutoConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    config = AutoConfig.for_model("qwen3_5_moe_text", hidden_size=64, num_hidden_layers=2, **QWEN35)
    torch.manual_seed(seed)
    block = Qwen3_5MoeSparseMoeBlock(config).eval().requires_grad_(False)
    for parameter in block.parameters():  # the router starts at zeros: give every part weights
        parameter.normal_(0, 0.1)
    return block, config


def test_the_recorded_routing_reproduces_the_blocks_output():
    """softmax -> top-k -> renormalise over the recorded choices, plus the gated shared expert, is
    exactly what the block computes: the experts are calibrated on the tokens the model sends them."""
    block, config = moe_block()
    x = torch.randn(1, 40, 64)
    routed: dict[str, calibrate.RoutedInputs] = {}
    with torch.no_grad():
        stats = calibrate.record(block, lambda: block(x), routed=routed)
        output = block(x).reshape(-1, 64)
    calls = routed["experts"]
    tokens, chosen = calls.hidden[0], calls.chosen[0]
    probabilities = torch.softmax(tokens @ block.gate.weight.T, dim=-1)
    top, index = probabilities.topk(config.num_experts_per_tok, dim=-1)
    assert torch.equal(index, chosen)
    weights = top / top.sum(-1, keepdim=True)
    experts = block.experts
    expected = torch.sigmoid(block.shared_expert_gate(tokens)) * block.shared_expert(tokens)
    for slot in range(config.num_experts_per_tok):
        for t in range(tokens.shape[0]):
            e = int(chosen[t, slot])
            gate, up = (experts.gate_up_proj[e] @ tokens[t]).chunk(2)
            expected[t] += weights[t, slot] * (experts.down_proj[e] @ (experts.act_fn(gate) * up))
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-6)
    for e in range(config.num_experts):  # and each expert's statistics count its own tokens
        own = (chosen == e).any(-1).sum().item()
        assert (stats[f"experts.{e}.gate_proj"].count if own else 0) == own
        assert torch.equal(calls.tokens(e), tokens[(chosen == e).any(-1)])


def test_experts_are_rounded_on_their_own_tokens():
    block, config = moe_block(1)
    experts = block.experts
    width = experts.gate_up_proj.shape[1] // 2
    needed = compensating_tokens(64)
    busy = torch.randn(needed + 10, 64) * torch.linspace(0.1, 3, 64)
    # expert 0 gets enough tokens for error-compensating rounding of every projection; expert 1 too few
    routed = calibrate.RoutedInputs([busy, torch.randn(3, 64)],
                                    [torch.zeros(needed + 10, 1, dtype=torch.long), torch.ones(3, 1, dtype=torch.long)])
    float_weights = experts.gate_up_proj.clone(), experts.down_proj.clone()
    stats = {f"experts.{e}.{p}": calibrate.ChannelStats(torch.rand(w) + 0.1, torch.ones(w), 100)
             for e in range(config.num_experts) for p, w in (("gate_proj", 64), ("up_proj", 64), ("down_proj", width))}
    rounded = round_experts(experts, "experts", lambda m: f"model.{m}.weight", stats, routed, CONFIG)
    assert rounded.projections == 3 * config.num_experts
    assert needed + 10 >= compensating_tokens(width)
    assert rounded.error_compensated == 3  # expert 0's gate, up and down
    hessian = busy.T @ busy / busy.shape[0]
    gptq = quantize_gptq(float_weights[0][0, :width], CONFIG, hessian)
    nearest = quantize(float_weights[0][1, :width], CONFIG, stats["experts.1.gate_proj"].importance)
    for kind in KINDS:
        assert torch.equal(rounded.tensors[f"model.experts.0.gate_proj.weight_{kind}"], getattr(gptq, kind)), kind
        assert torch.equal(rounded.tensors[f"model.experts.1.gate_proj.weight_{kind}"], getattr(nearest, kind)), kind
    # the module now holds what the checkpoint stores, for the next layer's inputs
    torch.testing.assert_close(experts.gate_up_proj[0, :width], dequantize(gptq, CONFIG))
    assert set(rounded.tensors) == {f"model.experts.{e}.{p}.weight_{k}" for e in range(config.num_experts)
                                    for p in ("gate_proj", "up_proj", "down_proj") for k in KINDS}


def test_every_expert_sees_every_token_for_statistics_only():
    """--expert-tokens all: each expert's statistics and recorded tokens are the whole block input
    (its down_proj's its own act(gate) * up of them); the block's output is the model's."""
    block, config = moe_block(2)
    x = torch.randn(1, 40, 64)
    with torch.no_grad():
        expected = block(x)
        routed: dict[str, calibrate.RoutedInputs] = {}
        stats = calibrate.record(block, lambda: block(x), routed=routed, every_expert=True)
        output = block(x)
    torch.testing.assert_close(output, expected)
    tokens = x.reshape(-1, 64)
    experts = block.experts
    for e in range(config.num_experts):
        assert stats[f"experts.{e}.gate_proj"].count == tokens.shape[0]
        assert torch.equal(routed["experts"].tokens(e), tokens)
        gate, up = (tokens @ experts.gate_up_proj[e].T).chunk(2, dim=-1)
        own = experts.act_fn(gate) * up
        torch.testing.assert_close(stats[f"experts.{e}.down_proj"].importance, (own * own).mean(0))
