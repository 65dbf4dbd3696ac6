"""How vLLM's engine processes wait for each other: a bound on vLLM's busy-wait
where the profile sets one. Called from the vLLM plugin's entry point
(a3b_backend/vllm_a3b.py: register), so it runs in every vLLM process before
its message queues exist."""
from __future__ import annotations

import os

from a3b_backend.profiles import ENGINE_BUSY_WAIT_ENV

# How often a reader past its busy-wait looks at the queue again without the
# writer's notification: with readers asleep after every message, some
# notifications never wake them (the notifier is a zmq PUB socket, which drops
# messages past its high-water mark of 1), and vLLM looks again only after 5 s
# (seen: EngineCore and its worker both asleep, each waiting for the other).
IDLE_RECHECK_MS = 1


def bound_busy_wait() -> None:
    """Where the profile asks (profiles.ENGINE_BUSY_WAIT_ENV), vLLM's engine
    processes busy-wait that long for each other's next message, then sleep
    until notified or IDLE_RECHECK_MS passes, instead of vLLM's fixed 1 s.

    Under load 1 s never lapses: EngineCore spins (sched_yield) on a whole core
    while its worker computes a step. Where the engine computes on the host's
    CPUs, that core is the one the serving processes run on, and each step
    starts only once the spinner gets the core back from them. vLLM 0.32 has no
    setting for it: its MessageQueue builds a SpinCondition per reader, so this
    swaps in one with the profile's busy-wait."""
    from vllm.distributed.device_communicators import shm_broadcast

    raw = os.environ.get(ENGINE_BUSY_WAIT_ENV)
    if raw is None:
        return
    busy_wait_s = float(raw)

    class BoundedSpinCondition(shm_broadcast.SpinCondition):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "busy_loop_s": busy_wait_s})

        def wait(self, timeout_ms: int | None = None) -> None:
            super().wait(IDLE_RECHECK_MS if timeout_ms is None else min(timeout_ms, IDLE_RECHECK_MS))

    shm_broadcast.SpinCondition = BoundedSpinCondition
