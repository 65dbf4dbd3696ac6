"""CUDA C++ A3B kernels: the sources compile for sm_90a with plain nvcc (no GPU
needed; a compile error fails the suite), and on a GPU they match the torch
reference on fresh random inputs."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from a3b_backend.quant.format import A3BConfig, quantize
from a3b_kernels import reference

CUDA_DIR = Path(__file__).resolve().parent.parent / "kernels" / "cuda"


@pytest.mark.parametrize("source", sorted(CUDA_DIR.glob("*.cu")), ids=lambda p: p.name)
def test_cuda_source_compiles_for_hopper(source, tmp_path):
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    assert Path(nvcc).exists(), "nvcc not found: the CUDA sources must be compile-checked"
    done = subprocess.run([nvcc, "-arch=sm_90a", "-O3", "-c", str(source), "-o", str(tmp_path / "k.o")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and torch with CUDA")
@pytest.mark.parametrize("m", [1, 4, 16])
def test_cuda_gemv_matches_reference(m):
    from a3b_kernels import cuda

    config = A3BConfig(1, 128, iterations=2)
    w = torch.randn(512, 1024) * 0.05
    q = quantize(w, config)
    q = type(q)(**{k: v.cuda() for k, v in vars(q).items()})
    x = torch.randn(m, 1024, device="cuda").to(torch.bfloat16)
    torch.testing.assert_close(cuda.a3b_gemv(x, q, config), reference.a3b_matmul(x, q, config), rtol=1e-4, atol=1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and torch with CUDA")
@pytest.mark.parametrize("heads, kv_heads, dim", [(16, 2, 256), (4, 4, 64), (8, 1, 128)])
def test_cuda_paged_decode_attention_matches_reference(heads, kv_heads, dim):
    from a3b_kernels import cuda, kv_cache

    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    seqs = kv_cache.random_sequences([5, 300, 1000], kv_heads, dim, min(128, dim), g)
    q = torch.randn(len(seqs.lens), heads, dim, generator=g).to(torch.bfloat16)
    expected = kv_cache.paged_decode_attention(q, seqs.k, seqs.v, seqs.tables, seqs.lens)
    on_gpu = [kv_cache.PagedA3B(c.codes.cuda(), c.meta.cuda()) for c in (seqs.k, seqs.v)]
    got = cuda.paged_decode_attention(q.cuda(), *on_gpu, seqs.tables.cuda(), seqs.lens.int().cuda(),
                                      pages_per_split=7)
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-3, atol=1e-3)
