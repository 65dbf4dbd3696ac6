"""The Triton A3B kernels as vLLM's compiled GPU engine calls them (a3b_kernels/triton/ops.py), on
the CPU: the custom ops pass torch's opcheck under Triton's interpreter, a graph compiled the way
vLLM compiles keeps choosing the launch from the run-time M, and the host code runs under
FakeTensorMode at Qwen3.6-35B-A3B's real shapes (no host sync, no data-dependent shape)."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton builds the kernels: run them on the CPU

import pytest  # noqa: E402
import torch  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from a3b_backend.quant.format import KERNEL_KINDS, A3BConfig, quantize, stack, stored_tensors  # noqa: E402
from a3b_kernels.reference import random_weight  # noqa: E402
from a3b_kernels.triton import a3b_gemv, a3b_matmul, a3b_moe, ops  # noqa: E402

CONFIG = A3BConfig(1, 128, iterations=1)
QWEN = dict(experts=256, hidden=2048, intermediate=512, top_k=8)


def weight(out: int, inp: int, seed: int = 0):
    return quantize(torch.randn(out, inp, generator=torch.Generator().manual_seed(seed)) * 0.05, CONFIG)


def test_the_ops_pass_opcheck():
    q = weight(64, 256)
    x = torch.randn(3, 256)
    torch.library.opcheck(torch.ops.a3b.gpu_linear, (x, *q.kernel_tensors(), CONFIG.block_cols))
    w13 = stack([weight(2 * 128, 256, e) for e in range(4)])
    w2 = stack([weight(256, 128, 10 + e) for e in range(4)])
    ids = torch.tensor([[0, 2], [3, -1], [1, 0]], dtype=torch.int32)  # -1: another rank's expert
    topk_weights = torch.softmax(torch.randn(3, 2), -1)
    torch.library.opcheck(torch.ops.a3b.gpu_moe,
                          (x, *w13.kernel_tensors(), *w2.kernel_tensors(), topk_weights, ids, CONFIG.block_cols))


def test_a_compiled_graph_chooses_the_launch_from_the_run_time_rows(monkeypatch):
    """Traced at M=64 as vLLM compiles (fullgraph, dynamic batch, guards dropped), called at M=1 and
    M=8: each call gets its own M's launch, not the trace's (one row: the GEMV without a table)."""
    chosen = []
    real, real_gemv = a3b_matmul.launch_for, a3b_matmul.a3b_gemv
    monkeypatch.setattr(a3b_matmul, "launch_for", lambda m: chosen.append(m) or real(m))
    monkeypatch.setattr(a3b_matmul, "a3b_gemv", lambda x, *args: chosen.append("gemv") or real_gemv(x, *args))
    q = weight(64, 256)

    def layer(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.a3b.gpu_linear(x * 2, *q.kernel_tensors(), CONFIG.block_cols).relu()

    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend="aot_eager",
                             options={"guard_filter_fn": lambda entries: [False] * len(entries)})
    for m in (64, 1, 8):
        x = torch.randn(m, 256)
        torch.testing.assert_close(compiled(x), layer(x))
    assert chosen[::2] == [64, "gemv", 8]  # the compiled call, then the eager reference, per M
    assert [real(m).block_m for m in (64, 8)] == [64, 16]


class NoLaunch:
    """A kernel whose launches do nothing: the host code alone runs."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@pytest.mark.parametrize("tokens", [1, 8, 8192])
def test_the_moe_host_code_runs_on_fake_tensors_at_qwen_shapes(monkeypatch, tokens):
    monkeypatch.setattr(a3b_moe, "_a3b_moe_kernel", NoLaunch())
    e, h, i, k = QWEN["experts"], QWEN["hidden"], QWEN["intermediate"], QWEN["top_k"]
    with FakeTensorMode():
        def stacked(out: int, inp: int):
            tensors = {kind: torch.empty((e, *spec.shape), dtype=spec.dtype)
                       for kind, spec in stored_tensors(out, inp, CONFIG.block).items() if kind != "shape"}
            return tuple(tensors[kind] for kind in KERNEL_KINDS)

        x = torch.empty(tokens, h, dtype=torch.bfloat16)
        ids = torch.empty(tokens, k, dtype=torch.int32)
        topk_weights = torch.empty(tokens, k)
        w13, w2 = ops._weight(stacked(2 * i, h), 2 * i, h), ops._weight(stacked(h, i), h, i)
        out = a3b_moe.a3b_moe(x, w13, w2, topk_weights, ids, CONFIG.block_cols)
    assert tuple(out.shape) == (tokens, h) and out.dtype == torch.float32


@pytest.mark.parametrize("rows", [1, 8, 8192])
@pytest.mark.parametrize("shape", [(12288, 2048), (2048, 4096), (1024, 2048)])
def test_the_linear_host_code_runs_on_fake_tensors_at_qwen_shapes(monkeypatch, rows, shape):
    monkeypatch.setattr(a3b_matmul, "_a3b_matmul_kernel", NoLaunch())
    monkeypatch.setattr(a3b_gemv, "_a3b_gemv_kernel", NoLaunch())
    out, inp = shape
    with FakeTensorMode():
        tensors = {kind: torch.empty(spec.shape, dtype=spec.dtype)
                   for kind, spec in stored_tensors(out, inp, CONFIG.block).items()}
        x = torch.empty(rows, inp, dtype=torch.bfloat16)
        y = a3b_matmul.a3b_matmul(x, ops._weight(tuple(tensors[k] for k in KERNEL_KINDS), out, inp), CONFIG)
    assert tuple(y.shape) == (rows, out)


def expert_output(x: torch.Tensor, w13, w2, expert: int) -> torch.Tensor:
    from a3b_backend.quant.format import dequantize

    gate, up = (x @ dequantize(w13.expert(expert), CONFIG).T).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up) @ dequantize(w2.expert(expert), CONFIG).T


@pytest.mark.slow  # 3m36s and 4m42s under the interpreter (Triton 3.9, 2 cores, beside other work)
def test_the_moe_op_follows_vllms_routing_contract_at_qwen_shape():
    """Qwen3.6's shape (256 experts, hidden 2048, 512 per expert, top-8): softmax -> top-8 ->
    renormalise, int32 ids as vLLM passes them; with expert parallelism over 2 ranks (vLLM's
    expert_map: global id -> local id, -1 elsewhere) each rank's output is its experts' share and the
    two add up to the whole. The shared expert is not the op's: vLLM adds it outside."""
    e, h, i, k = QWEN["experts"], QWEN["hidden"], QWEN["intermediate"], QWEN["top_k"]
    generator = torch.Generator().manual_seed(3)
    w13, w2 = random_weight(e, 2 * i, h, generator=generator), random_weight(e, h, i, generator=generator)
    x = torch.randn(3, h, generator=generator)
    probabilities = torch.softmax(x @ torch.randn(e, h, generator=generator).T / h**0.5, dim=-1)
    top, ids = probabilities.topk(k, dim=-1)
    weights, ids = top / top.sum(-1, keepdim=True), ids.to(torch.int32)
    expected = torch.zeros(3, h)
    for t in range(3):
        for slot in range(k):
            expected[t] += weights[t, slot] * expert_output(x[t:t + 1], w13, w2, int(ids[t, slot]))[0]
    whole = ops.gpu_moe(x, *w13.kernel_tensors(), *w2.kernel_tensors(), weights, ids, CONFIG.block_cols)
    scale = expected.abs().max()
    torch.testing.assert_close(whole, expected, rtol=0, atol=2**-7 * scale)
    half = e // 2
    shares = []
    for rank in range(2):
        expert_map = torch.full((e,), -1, dtype=torch.int32)
        expert_map[rank * half:(rank + 1) * half] = torch.arange(half, dtype=torch.int32)
        local = [w.kernel_tensors() for w in (w13, w2)]
        local = [tuple(t[rank * half:(rank + 1) * half] for t in tensors) for tensors in local]
        shares.append(ops.gpu_moe(x, *local[0], *local[1], weights, expert_map[ids.long()], CONFIG.block_cols))
    torch.testing.assert_close(shares[0] + shares[1], whole, rtol=0, atol=2**-7 * scale)
