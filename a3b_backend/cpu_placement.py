"""Keeps tritonserver, its Python stubs and vLLM's EngineCore off the cores
that vLLM's CPU workers compute on.

vLLM's CPU backend binds each worker's OpenMP threads to cores of their own
and leaves the rest to "other processes" (VLLM_CPU_OMP_THREADS_BIND=auto,
vllm/utils/ompmultiprocessing.py), but nothing keeps those other processes
off the workers' cores: every wake-up of the server, a stub or the engine's
scheduler on them takes the core from a decode step in flight, so each
streamed response lengthens the next step. Moving every other thread of the
tree onto the cores no worker holds gives the workers theirs alone (README
Performance, "Serving overhead", has what it changes).
"""
from __future__ import annotations

import dataclasses
import logging
import os

log = logging.getLogger(__name__)

WORKER_PROCESS_PREFIX = "VLLM::Worker"


def _is_worker(proc) -> bool:
    return proc.name().startswith(WORKER_PROCESS_PREFIX)


def _tree(root_pid: int) -> list:
    import psutil

    root = psutil.Process(root_pid)
    return [root, *root.children(recursive=True)]


def _place_threads(proc, cores: frozenset[int]) -> None:
    import psutil

    try:
        thread_ids = [t.id for t in proc.threads()]
    except psutil.NoSuchProcess:
        return
    for tid in thread_ids:
        try:
            os.sched_setaffinity(tid, cores)
        except ProcessLookupError:  # the thread ended meanwhile
            pass


@dataclasses.dataclass(frozen=True)
class CorePlacement:
    """The cores of one process tree (`root_pid` and its descendants), taken
    before any of its threads is moved."""

    root_pid: int
    cores: frozenset[int]

    @classmethod
    def of_tree(cls, root_pid: int) -> "CorePlacement":
        return cls(root_pid, frozenset(os.sched_getaffinity(root_pid)))

    def keep_off_workers(self) -> frozenset[int]:
        """Moves every thread of the tree that is not in a vLLM CPU worker onto
        the cores no worker is bound to, and returns those cores; empty when
        nothing moved (no worker bound to fewer than all the cores, or none left over)."""
        procs = _tree(self.root_pid)
        worker_cores = set()
        for proc in procs:
            if _is_worker(proc):
                worker_cores |= set(proc.cpu_affinity())
        rest = frozenset(self.cores - worker_cores)
        if not worker_cores or not rest:
            return frozenset()
        self._place_all_but_workers(procs, rest)
        return rest

    def follow_engine(self, up: bool) -> None:
        """Engine up: keep the rest off its workers' cores; going down for a
        restart: give the tree all its cores back for the new engine's workers."""
        if not up:
            self.release()
            return
        rest = self.keep_off_workers()
        if rest:
            log.info("vLLM's CPU workers have cores of their own; the serving processes run on cores %s",
                     sorted(rest))

    def release(self) -> None:
        """Every thread of the tree back on all the tree's cores, before a new
        engine starts: its workers bind to cores among those its process may use."""
        self._place_all_but_workers(_tree(self.root_pid), self.cores)

    @staticmethod
    def _place_all_but_workers(procs: list, cores: frozenset[int]) -> None:
        for proc in procs:
            if not _is_worker(proc):
                _place_threads(proc, cores)
