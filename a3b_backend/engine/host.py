"""Owns vLLM's AsyncLLM on an asyncio loop thread of its own.

Triton calls `execute` on its own thread; requests are handed to this loop and
stream back from it, so many requests are in flight at once and vLLM batches
them continuously.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from typing import Any, AsyncIterator, Callable, Coroutine

log = logging.getLogger(__name__)


def cpu_kv_cache_problem(engine_args: dict[str, Any]) -> str | None:
    """Why vLLM's CPU backend cannot hold this KV cache here, or None: its fp8 KV cache needs
    AVX-512 or AMX, and without them its workers die at startup behind a generic error."""
    import torch

    dtype = engine_args.get("kv_cache_dtype", "auto")
    if not dtype.startswith("fp8") or torch.cuda.is_available():
        return None
    if torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported():
        return None
    return (f"kv_cache_dtype {dtype!r} on vLLM's CPU backend needs a CPU with AVX-512 or AMX, and this one has "
            "neither: serve this profile on a GPU host or an AVX-512 CPU, or choose a profile with "
            "kv_cache_dtype 'auto'")


class EngineHost:
    def __init__(self, engine_args: dict[str, Any], env: dict[str, str] | None = None,
                 stat_loggers: list | None = None, on_state: Callable[[bool], None] = lambda up: None,
                 on_in_flight: Callable[[int], None] = lambda count: None, restart_needs: str | None = None):
        for key, value in (env or {}).items():
            os.environ.setdefault(key, value)
        self._engine_args, self._stat_loggers, self._on_state = engine_args, stat_loggers or [], on_state
        self._on_in_flight = on_in_flight
        self._restart_needs = restart_needs
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="a3b-engine-loop", daemon=True)
        self._thread.start()
        self._in_flight: dict[str, concurrent.futures.Future] = {}
        self._restarting = False
        self.engine = self.call(self._build(engine_args, self._stat_loggers))
        on_state(True)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def healthy(self) -> bool:
        return not self._restarting and not self.engine.errored

    def restart_if_dead(self) -> None:
        """Replace a dead engine (its EngineCore process died) with a new one.

        Runs on the engine loop; while it runs, `healthy` is False and callers
        answer new requests with a retryable error instead of queueing them."""
        if self._restarting or not self.engine.errored:
            return
        self._restarting = True
        self._on_state(False)
        log.error("vLLM engine died; starting a new one%s", f" ({self._restart_needs})" if self._restart_needs else "")

        async def rebuild():
            try:
                self.engine.shutdown()
            except Exception:  # the old engine is dead already; keep going
                log.exception("shutting down the dead engine failed")
            while True:
                try:
                    self.engine = await self._build(self._engine_args, self._stat_loggers)
                    break
                except Exception:
                    log.exception("engine restart failed; retrying in 5 s")
                    await asyncio.sleep(5)
            self._restarting = False
            self._on_state(True)
            log.warning("vLLM engine restarted")

        asyncio.run_coroutine_threadsafe(rebuild(), self._loop)

    @staticmethod
    async def _build(engine_args: dict[str, Any], stat_loggers: list):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        problem = cpu_kv_cache_problem(engine_args)
        if problem:
            raise RuntimeError(problem)
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args), stat_loggers=stat_loggers)

    def call(self, coro: Coroutine, timeout: float | None = None) -> Any:
        """Run a coroutine on the engine loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def submit(self, request_id: str, coro: Coroutine) -> concurrent.futures.Future:
        """Start a request's coroutine on the engine loop; returns at once."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        self._in_flight[request_id] = future
        self._on_in_flight(self.in_flight)
        future.add_done_callback(lambda _f: self._finished(request_id))
        return future

    def _finished(self, request_id: str) -> None:
        self._in_flight.pop(request_id, None)
        self._on_in_flight(self.in_flight)

    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params,
                       lora_request=None) -> AsyncIterator[Any]:
        from vllm.inputs import TokensPrompt

        async for output in self.engine.generate(
            TokensPrompt(prompt_token_ids=prompt_ids), sampling_params, request_id, lora_request=lora_request
        ):
            yield output

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    def submit_abort(self, request_id: str) -> None:
        """Abort from any thread; unknown or finished ids are ignored."""
        if request_id in self._in_flight:
            asyncio.run_coroutine_threadsafe(self.abort(request_id), self._loop)

    def refusal(self, max_in_flight: int) -> str | None:
        """Why the engine must refuse a new request now (retryable), or None to admit it."""
        if not self.healthy:
            needs = f"; {self._restart_needs}" if self._restart_needs else ""
            return f"engine restarting after a failure; retry in a few seconds{needs}"
        if self.in_flight >= max_in_flight:
            return (f"server busy: {self.in_flight} requests in flight, the limit is {max_in_flight} "
                    "(profile max_in_flight); retry later")
        return None

    def shutdown(self, drain_timeout: float = 10.0) -> None:
        """Let in-flight requests finish for a while, abort the rest, stop the engine."""
        pending = list(self._in_flight.values())
        if pending:
            concurrent.futures.wait(pending, timeout=drain_timeout)
        for future in list(self._in_flight.values()):
            future.cancel()
        try:
            self.engine.shutdown()
        except Exception:  # shutting down anyway; report, do not mask the exit
            log.exception("engine shutdown failed")
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
