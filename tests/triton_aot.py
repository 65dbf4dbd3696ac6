"""Compiles every Triton kernel build (a3b_kernels/triton/aot.py) for every target on the CPU. Run in a
process of its own by tests/test_kernels_aot.py: the kernels must be imported without
TRITON_INTERPRET, which the other kernel tests set before importing them. Prints one line per
build: RESULT <target> <name> | ok|failed <error>.

    python tests/triton_aot.py
"""
from __future__ import annotations

import itertools

import triton

from a3b_kernels.triton.aot import TARGETS, builds


def main() -> None:
    for build, (target, gpu) in itertools.product(builds(), TARGETS.items()):
        try:
            status = "ok" if build.compile(gpu).asm["cubin"] else "failed no cubin"
        except triton.CompilationError as exc:
            status = "failed " + str(exc).splitlines()[0]
        print(f"RESULT {target} {build.name} | {status}", flush=True)


if __name__ == "__main__":
    main()
