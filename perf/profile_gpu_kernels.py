"""One call of each A3B weight kernel at the benchmark's headline shape
(8192x8192; the Triton matmul at 1 and 16 rows of x, the CUDA GEMV at 1), for
a profiler to wrap: `make profile-gpu` runs it under Nsight Compute, which
prints each kernel's throughput, occupancy and warp-stall sections.

    python perf/profile_gpu_kernels.py [--shape 8192 8192]
"""
from __future__ import annotations

import argparse
import sys



def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=int, nargs=2, default=(8192, 8192), metavar=("N", "K"))
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("perf/profile_gpu_kernels.py needs a CUDA GPU and torch with CUDA; this machine has neither",
              file=sys.stderr)
        return 2
    from gpu_kernels import GPU, random_a3b

    from a3b_backend.quant.format import A3BConfig
    from a3b_kernels import cuda
    from a3b_kernels.triton import a3b_matmul

    n, k = args.shape
    config = A3BConfig(1, GPU.group)
    weight = random_a3b(n, k, GPU.group, "cuda")
    for m in (1, 16):
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        print(f"triton a3b_matmul {n}x{k} M={m}: {a3b_matmul.launch_for(m)}", flush=True)
        a3b_matmul.a3b_matmul(x, weight, config)
    print(f"cuda a3b_gemv {n}x{k} M=1", flush=True)
    cuda.a3b_gemv(torch.randn(1, k, device="cuda").to(torch.bfloat16), weight, config)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
