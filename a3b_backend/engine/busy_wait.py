"""How vLLM's engine processes wait for each other: a bound on vLLM's busy-wait
where the profile sets one. Called from the vLLM plugin's entry point
(a3b_backend/engine/a3b_method.py: register), so it runs in every vLLM process before
its message queues exist."""
from __future__ import annotations

import os
import time

from a3b_backend.profiles import ENGINE_BUSY_WAIT_ENV

# How often a reader past its busy-wait looks at the queue again without the
# writer's notification: with readers asleep after every message, some
# notifications never wake them (the notifier is a zmq PUB socket, which drops
# messages past its high-water mark of 1), and vLLM looks again only after 5 s
# (seen: EngineCore and its worker both asleep, each waiting for the other).
ACTIVE_RECHECK_MS = 1
# While the last message is older than ACTIVE_WINDOW_S (vLLM's own busy-wait),
# the engine is idle and a reader looks again only every IDLE_RECHECK_MS, so an
# idle engine's worker does not wake 1,000 times a second on the CPU it is bound
# to (a busy engine of another process may be bound to the same one).
ACTIVE_WINDOW_S = 1.0
IDLE_RECHECK_MS = 50


def recheck_ms(since_last_read_s: float) -> int:
    """How long a sleeping reader waits for a notification before it looks again."""
    return ACTIVE_RECHECK_MS if since_last_read_s < ACTIVE_WINDOW_S else IDLE_RECHECK_MS


def bound_busy_wait() -> None:
    """Where the profile asks (profiles.ENGINE_BUSY_WAIT_ENV), vLLM's engine
    processes busy-wait that long for each other's next message, then sleep
    until notified or `recheck_ms` passes, instead of vLLM's fixed 1 s.

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
            recheck = recheck_ms(time.monotonic() - self.last_read)
            super().wait(recheck if timeout_ms is None else min(timeout_ms, recheck))

    shm_broadcast.SpinCondition = BoundedSpinCondition
