"""a3b-triton: serving logic behind the Triton model repository (benchmark
tooling lives apart in `a3b_backend.bench`, the A3B kernels in `a3b_kernels`)."""
