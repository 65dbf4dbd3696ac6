"""Block-wise tuning of A3B's rounding and metadata (a3b_backend/quant/block_tune.py) on fresh
random layers: the trainable linear computes the weight it stores, every parameter gets gradient,
tuning lowers the held-out loss and never returns worse than its start."""
import torch

from a3b_backend.quant.block_tune import (HELD_OUT_EVERY, BlockTuneConfig, RoundedLinear, held_out_windows,
                                          tune_block)
from a3b_backend.quant.format import A3BConfig, dequantize, quantize, unpack_codes

CONFIG = A3BConfig(1, 32, iterations=2)


def test_the_rounded_linear_starts_at_the_stored_weight_and_stores_what_it_computes():
    torch.manual_seed(0)
    w = torch.randn(24, 70)
    q = quantize(w, CONFIG)  # a partial last block and an odd width
    layer = RoundedLinear(q, CONFIG, w)
    assert torch.allclose(layer.weight(), dequantize(q, CONFIG), atol=1e-6)
    assert torch.equal(dequantize(layer.stored(), CONFIG), dequantize(q, CONFIG))
    with torch.no_grad():
        layer.rounding.uniform_(-1, 1)
        layer.code_offsets.uniform_(-2, 2)
        layer.log_gain.uniform_(-0.05, 0.05)
    stored = layer.stored()
    assert torch.allclose(layer.weight(), dequantize(stored, CONFIG), atol=1e-6)
    assert not torch.equal(stored.packed, q.packed)


def test_every_parameter_gets_gradient_through_the_rounding():
    torch.manual_seed(1)
    w = torch.randn(16, 64)
    layer = RoundedLinear(quantize(w, CONFIG), CONFIG, w)
    layer(torch.randn(5, 64)).square().sum().backward()
    for name in ("rounding", "code_offsets", "log_gain"):
        assert getattr(layer, name).grad is not None and getattr(layer, name).grad.abs().sum() > 0, name


class Block(torch.nn.Module):
    """A residual MLP with outlier channels in its input, as a decoder layer's residual stream has."""

    def __init__(self, width: int = 64):
        super().__init__()
        self.up = torch.nn.Linear(width, 4 * width, bias=False)
        self.down = torch.nn.Linear(4 * width, width, bias=False)

    def forward(self, x):
        return x + self.down(torch.nn.functional.silu(self.up(x)))


def _quantized(block: Block) -> tuple[dict, dict]:
    """The block's linears rounded (nearest) and their float weights; the block holds the rounded
    values, as the layer pipeline hands it to the tuning."""
    floats = {name: getattr(block, name).weight.detach().clone() for name in ("up", "down")}
    weights = {name: quantize(w, CONFIG) for name, w in floats.items()}
    with torch.no_grad():
        for name, q in weights.items():
            getattr(block, name).weight.copy_(dequantize(q, CONFIG))
    return weights, floats


def _windows(count: int, width: int = 64) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    gains = torch.ones(width)
    gains[:3] = 20.0
    return [torch.randn(1, 32, width, generator=generator) * gains for _ in range(count)]


def _tune(block: Block, inputs: list, targets: list, weights: dict, floats: dict, tune_config: BlockTuneConfig):
    return tune_block(block, weights, floats, CONFIG, lambda i: block(inputs[i]), targets,
                      {name: (None, None) for name in weights}, tune_config)


def _setup(seed: int) -> tuple[Block, list, list, dict, dict]:
    """A block, its windows, its float outputs there, and its linears rounded (the block holding them)."""
    torch.manual_seed(seed)
    block = Block()
    inputs = _windows(2 * HELD_OUT_EVERY)
    with torch.no_grad():
        targets = [block(x) for x in inputs]
    return block, inputs, targets, *_quantized(block)


def test_tuning_lowers_the_held_out_loss_and_changes_the_stored_codes():
    block, inputs, targets, weights, floats = _setup(3)
    tuned = _tune(block, inputs, targets, weights, floats, BlockTuneConfig(steps=40, batch=2, evaluate_every=10))
    assert tuned.best_step > 0 and tuned.held_out_after < 0.9 * tuned.held_out_before, tuned
    assert all(not torch.equal(unpack_codes(tuned.weights[n].packed), unpack_codes(weights[n].packed))
               for n in weights)
    # what is stored gives the held-out loss reported
    held_out = held_out_windows(len(inputs))
    for name, q in tuned.weights.items():
        setattr(block, name, torch.nn.Linear(1, 1, bias=False))
        getattr(block, name).weight.data = dequantize(q, CONFIG)
    channel_ms = torch.cat([targets[i] for i in range(len(inputs)) if i not in held_out]).square().mean((0, 1))
    with torch.no_grad():
        loss = sum(float(((block(inputs[i]) - targets[i]).square() / channel_ms).mean()) for i in held_out)
    assert abs(loss / len(held_out) - tuned.held_out_after) < 1e-3 * tuned.held_out_after


def test_a_tuning_that_never_beats_its_start_keeps_the_untuned_weights():
    """Held-out targets that the untuned rounding meets exactly: any tuned step is worse there."""
    block, inputs, targets, weights, floats = _setup(4)
    with torch.no_grad():
        for i in held_out_windows(len(inputs)):
            targets[i] = block(inputs[i])
    tuned = _tune(block, inputs, targets, weights, floats, BlockTuneConfig(steps=4, batch=2, evaluate_every=1))
    assert tuned.best_step == 0 and tuned.held_out_after == tuned.held_out_before < 1e-9
    assert all(tuned.weights[n] is weights[n] for n in weights)
