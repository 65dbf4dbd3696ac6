"""Deployment profiles: the one source of truth for engine and model settings.

Every model in the repository reads its settings from here (selected by the
A3B_PROFILE environment variable), so the tokenizer, the engine and the
request limits can never disagree.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

# The checkout (the package is installed editable): models/, model_repository/, perf/ and scripts/ sit here.
PROJECT_ROOT = Path(__file__).resolve().parent.parent
# Real English text on every Debian machine: calibration text and the perf corpus.
LICENCE_TEXTS = Path("/usr/share/common-licenses")
PROFILE_ENV = "A3B_PROFILE"
MODEL_DIR_ENV = "A3B_MODEL_DIR"
DEFAULT_PROFILE = "cpu"
# Where a process sits in a multi-node engine: every node runs the same
# profile, so these come from its environment (scripts/serve.sh is node 0,
# scripts/vllm_node.sh the others).
NODE_RANK_ENV, MASTER_ADDR_ENV, MASTER_PORT_ENV = "A3B_NODE_RANK", "A3B_MASTER_ADDR", "A3B_MASTER_PORT"
DEFAULT_MASTER_PORT = 29501
# Read by vLLM's processes (a3b_backend/engine/busy_wait.py)
ENGINE_BUSY_WAIT_ENV = "A3B_ENGINE_BUSY_WAIT_S"


@dataclasses.dataclass(frozen=True)
class NodePlacement:
    node_rank: int
    master_addr: str
    master_port: int

    @classmethod
    def from_env(cls) -> "NodePlacement":
        return cls(node_rank=int(os.environ.get(NODE_RANK_ENV, "0")),
                   master_addr=os.environ.get(MASTER_ADDR_ENV, "127.0.0.1"),
                   master_port=int(os.environ.get(MASTER_PORT_ENV, str(DEFAULT_MASTER_PORT))))


@dataclasses.dataclass(frozen=True)
class PerfPlan:
    """What `make perf` / perf_analyzer measure for a profile (perf/README.md)."""
    prompt_lengths: tuple[int, ...]
    output_tokens: int
    concurrencies: tuple[int, ...]
    # perf_analyzer count_windows: requests per measurement window
    requests_per_window: int
    # RAG mix: one document chunk of this many tokens behind a shared system prompt
    rag_document_tokens: int
    # a request-rate run (requests per minute), None for no such run
    request_rate_per_min: int | None = None
    windows: int = 3

    def requests_per_run(self, concurrency: int) -> int:
        """Prompts one perf_analyzer run may send: its windows plus those still in flight."""
        return self.windows * self.requests_per_window + concurrency

    @property
    def prompts_per_file(self) -> int:
        """Enough distinct prompts that no run repeats one an earlier run sent."""
        rate_run = self.requests_per_run(1) if self.request_rate_per_min else 0
        return sum(self.requests_per_run(c) for c in self.concurrencies) + rate_run


GPU_PERF = PerfPlan(
    # "128K" leaves room for the answer inside the 131072-token context
    prompt_lengths=(128, 1024, 8192, 32768, 130048),
    output_tokens=256,
    concurrencies=(1, 2, 4, 8, 16),
    requests_per_window=8,
    rag_document_tokens=86016,
    request_rate_per_min=200,
)


@dataclasses.dataclass(frozen=True)
class Profile:
    name: str
    # Relative paths are resolved against the project root (the parent of
    # model_repository/), absolute ones are used as they are.
    model_dir: str
    max_model_len: int
    default_max_tokens: int
    # The model's own context limit (max_position_embeddings): max_model_len may not exceed it.
    model_context_limit: int
    # Hardware the profile is sized for: GPUs per node (0 = CPU) and nodes.
    gpus_per_node: int = 0
    nodes: int = 1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Whole experts per rank instead of slicing every expert across ranks: A3B
    # blocks (1x128) cannot be cut by a tensor-parallel split of the 512-wide
    # expert intermediate into 64-column slices.
    enable_expert_parallel: bool = False
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float = 0.9
    dtype: str = "auto"
    enforce_eager: bool = False
    quantization: str | None = None
    distributed_executor_backend: str | None = None
    # Across nodes, the longest an engine step may wait for its workers: a
    # lost node fails the requests in flight after this long instead of never
    # (vLLM's default is 300 s; a step takes well under a second on GPUs).
    execute_timeout_s: int | None = None
    # vLLM's parsers for return_reasoning / return_tool_calls (None: refused)
    reasoning_parser: str | None = None
    tool_parser: str | None = None
    # LoRA limits, used when the repository enables adapters (a3b_backend/serving/lora.py):
    # the largest adapter rank and the adapters one batch may mix.
    max_lora_rank: int = 16
    max_loras: int = 4
    cpu_kv_cache_gib: int = 2
    # Seconds vLLM's engine processes busy-wait for each other's next message
    # before sleeping until notified; None keeps vLLM's 1 s, which never lapses
    # while streams run. Where the engine computes on the CPUs, EngineCore
    # spinning through every step holds a core the serving path needs
    # (docs/performance.md, "Serving overhead"), so it sleeps at once there.
    engine_busy_wait_s: float | None = None
    trust_remote_code: bool = False
    # Request limits enforced before anything reaches the engine. Past
    # max_in_flight, a3b_llm answers "server busy" at once instead of queueing
    # without bound.
    max_in_flight: int = 256
    max_stop_words: int = 16
    max_stop_word_chars: int = 256
    # Responses per second all streams together may send (a3b_backend/serving/pacing.py):
    # below the serving path's ceiling, which make bench-serving-path measured
    # at about 2,000 per second on the 2-core CPU machine (docs/performance.md,
    # where 1,600 against 1,200 is compared too). Hosts with more cores carry
    # more; measure there with the same command before raising it.
    stream_responses_per_s: float = 1600.0
    perf: PerfPlan = GPU_PERF

    @property
    def parses_output(self) -> bool:
        """Whether reasoning or tool calls can be parsed out of answers (return_reasoning / return_tool_calls)."""
        return self.reasoning_parser is not None or self.tool_parser is not None

    @property
    def restart_needs(self) -> str | None:
        """What a restarted engine waits for beyond itself, told to clients and the log meanwhile."""
        if self.nodes > 1:
            return (f"the engine spans {self.nodes} nodes and starts only once all have joined: "
                    "start any lost node again (scripts/vllm_node.sh)")
        return None

    def resolve_model_dir(self, project_root: Path) -> Path:
        override = os.environ.get(MODEL_DIR_ENV)
        path = Path(override or self.model_dir)
        return path if path.is_absolute() else (project_root / path).resolve()

    def engine_env(self) -> dict[str, str]:
        """Environment for vLLM processes: an explicit CPU KV size (vLLM's CPU
        default reserves 90% of RAM and refuses to start beside another engine)."""
        env = {"VLLM_CPU_KVCACHE_SPACE": str(self.cpu_kv_cache_gib)}
        if self.engine_busy_wait_s is not None:
            env[ENGINE_BUSY_WAIT_ENV] = str(self.engine_busy_wait_s)
        if self.execute_timeout_s is not None:
            env["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] = str(self.execute_timeout_s)
        return env

    def engine_args(self, project_root: Path, enable_lora: bool = False) -> dict[str, Any]:
        """Keyword arguments for vLLM's AsyncEngineArgs."""
        args: dict[str, Any] = dict(
            model=str(self.resolve_model_dir(project_root)),
            max_model_len=self.max_model_len,
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            enable_expert_parallel=self.enable_expert_parallel,
            kv_cache_dtype=self.kv_cache_dtype,
            enable_prefix_caching=self.enable_prefix_caching,
            enable_chunked_prefill=self.enable_chunked_prefill,
            max_num_seqs=self.max_num_seqs,
            gpu_memory_utilization=self.gpu_memory_utilization,
            dtype=self.dtype,
            trust_remote_code=self.trust_remote_code,
            enforce_eager=self.enforce_eager,
            load_format="safetensors",
        )
        optional = dict(
            max_num_batched_tokens=self.max_num_batched_tokens,
            quantization=self.quantization,
            distributed_executor_backend=self.distributed_executor_backend,
        )
        args.update({k: v for k, v in optional.items() if v is not None})
        if self.gpus_per_node == 0:
            args["block_size"] = CPU_KV_BLOCK_SIZE
        if enable_lora:
            args.update(enable_lora=True, max_lora_rank=self.max_lora_rank, max_loras=self.max_loras)
        if self.nodes > 1:
            placement = NodePlacement.from_env()
            args.update(nnodes=self.nodes, node_rank=placement.node_rank, master_addr=placement.master_addr,
                        master_port=placement.master_port)
        return args


# vllm-cpu's own default KV block size, passed explicitly: vLLM 0.32's CPU
# EngineCore re-runs its config check after start-up, which resets a block size
# the user did not give to 128. On a hybrid model that undoes the enlarged
# (Mamba-page-sized) block the KV cache was built with, so align-mode prefill
# chunks end on the wrong grid and a document's state is cached only from its
# third use (docs/performance.md, "Long context (128K) on the CPU").
CPU_KV_BLOCK_SIZE = 128
# Qwen3.6-35B-A3B's native context (its config.json max_position_embeddings)
QWEN36_CONTEXT = 262144
# What every Qwen3.6-35B-A3B profile shares: the A3B checkpoint a3b-quantize
# writes, 128K context, fp8 KV cache.
QWEN36_SERVING = dict(model_dir="models/qwen3.6-35b-a3b-a3b", max_model_len=131072, default_max_tokens=2048,
                      model_context_limit=QWEN36_CONTEXT, kv_cache_dtype="fp8", max_num_seqs=64,
                      gpu_memory_utilization=0.92, reasoning_parser="qwen3", tool_parser="qwen3_coder")

_SINGLE_NODE = (
    Profile(
        name="cpu",
        # `make model`: SmolLM2-135M-Instruct converted to A3B by a3b-quantize
        model_dir="models/smollm2-135m-instruct-a3b",
        max_model_len=8192,
        default_max_tokens=512,
        model_context_limit=8192,
        # vLLM's start-up profile run is one forward of max_num_batched_tokens:
        # keep it small on 2 cores (chunked prefill splits longer prompts).
        max_num_seqs=16,
        max_num_batched_tokens=1024,
        max_in_flight=64,
        cpu_kv_cache_gib=2,
        engine_busy_wait_s=0.0,
        # Eager float32 (make bench-cpu-modes, perf/results/cpu_engine_modes.md):
        # without AVX-512 BF16, torch's bf16 GEMM is a scalar loop (prefill
        # 6.7x slower); compiled mode starts 5x slower for 12% more decode.
        enforce_eager=True,
        dtype="float32",
        perf=PerfPlan(prompt_lengths=(128, 1024, 2048), output_tokens=32, concurrencies=(1, 4),
                      requests_per_window=3, rag_document_tokens=1536),
    ),
    Profile(
        name="h200",
        **QWEN36_SERVING,
        gpus_per_node=1,
        max_num_batched_tokens=8192,
    ),
    Profile(
        name="a100x8",
        **QWEN36_SERVING,
        gpus_per_node=8,
        tensor_parallel_size=8,
        enable_expert_parallel=True,
        max_num_batched_tokens=4096,
        distributed_executor_backend="mp",
    ),
)
# Qwen3.6-35B-A3B's text architecture at toy width (`make model-qwen`,
# a3b_backend/prepare/qwen_tiny.py), A3B-quantized, on the CPU stack: the h200
# profile's settings with CPU numbers. bf16 because vLLM's CPU Gated DeltaNet
# kernel runs in bf16 only; eager, as the cpu profile.
_QWEN_TINY = Profile(
    name="qwen-tiny",
    **{**QWEN36_SERVING, "model_dir": "models/qwen3.6-tiny-a3b", "default_max_tokens": 256, "max_num_seqs": 8},
    # Chunks of 4 hybrid blocks (vLLM sizes the block to hold one DeltaNet
    # state: 640 tokens here), which align-mode prefix caching cuts prefill on.
    max_num_batched_tokens=2560,
    max_in_flight=32,
    # fp8 attention KV is 2 KiB a token here (0.25 GiB at 128K); the rest holds
    # DeltaNet states and a few concurrent long prompts.
    cpu_kv_cache_gib=1,
    engine_busy_wait_s=0.0,
    enforce_eager=True,
    dtype="bfloat16",
    # GPU_PERF's prompt lengths and RAG document, each length at concurrency 1
    # over the fewest windows perf_analyzer reports (make perf, docs/performance.md).
    perf=PerfPlan(prompt_lengths=GPU_PERF.prompt_lengths, output_tokens=32, concurrencies=(1,), requests_per_window=1,
                  rag_document_tokens=GPU_PERF.rag_document_tokens),
)


def across_nodes(base: Profile, name: str, nodes: int, **changes: Any) -> Profile:
    """`base` spread over `nodes` machines by vLLM's multiprocessing executor
    (nnodes / node_rank / master_addr): pipeline stages across the nodes,
    `base`'s tensor parallelism inside each. Node 0 runs the server and the
    engine; the others run vLLM's headless workers (scripts/vllm_node.sh)."""
    return dataclasses.replace(base, name=name, nodes=nodes, pipeline_parallel_size=nodes,
                               distributed_executor_backend="mp", execute_timeout_s=30, **changes)


# Beyond one node (docs/deployment.md): a100x8's settings on two nodes. Sized
# for a model that needs 16 GPUs; point A3B_MODEL_DIR at it.
_MULTINODE = across_nodes(_SINGLE_NODE[-1], "multinode", nodes=2)
# The same mechanism proven on the CPU stack: the default model's 30 layers as
# two pipeline stages, one worker per node (its 9 attention heads rule out
# tensor parallel 2). Compiled, not eager: vllm-cpu 0.32 allocates a later
# stage's receive buffer only in the compile warm-up, and eager pipeline
# parallelism fails its first step (AssertionError in
# sync_and_gather_intermediate_tensors).
_CPU_2NODE = across_nodes(_SINGLE_NODE[0], "cpu-2node", nodes=2, enforce_eager=False)
PROFILES: dict[str, Profile] = {p.name: p for p in (*_SINGLE_NODE, _QWEN_TINY, _MULTINODE, _CPU_2NODE)}


def get_profile(name: str | None = None) -> Profile:
    """The profile named explicitly, else by $A3B_PROFILE, else the default."""
    chosen = name or os.environ.get(PROFILE_ENV) or DEFAULT_PROFILE
    try:
        return PROFILES[chosen]
    except KeyError:
        raise ValueError(
            f"unknown profile {chosen!r} (from {PROFILE_ENV}); known: {', '.join(PROFILES)}"
        ) from None


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
EXECUTORS = (None, "mp", "ray", "uni")


def check_profile(p: Profile) -> list[str]:
    """Problems that would only show on the target hardware, found here."""
    problems = []
    world = p.tensor_parallel_size * p.pipeline_parallel_size
    if p.gpus_per_node == 0:
        if p.tensor_parallel_size != 1 or world != p.nodes:
            problems.append(f"{p.name}: a CPU profile runs one worker per node (tp*pp={world}, nodes={p.nodes})")
    elif world != p.gpus_per_node * p.nodes:
        problems.append(f"{p.name}: tensor_parallel_size*pipeline_parallel_size = {world} but the profile declares "
                        f"{p.gpus_per_node} GPUs x {p.nodes} nodes = {p.gpus_per_node * p.nodes}")
    if p.tensor_parallel_size > max(p.gpus_per_node, 1):
        problems.append(f"{p.name}: tensor parallel size {p.tensor_parallel_size} spans nodes "
                        f"({p.gpus_per_node} GPUs per node); use pipeline parallelism across nodes")
    if p.max_model_len > p.model_context_limit:
        problems.append(f"{p.name}: max_model_len {p.max_model_len} exceeds the model's context "
                        f"{p.model_context_limit}")
    if p.default_max_tokens >= p.max_model_len:
        problems.append(f"{p.name}: default_max_tokens {p.default_max_tokens} leaves no room for a prompt")
    if p.nodes > 1 and p.distributed_executor_backend != "mp":
        problems.append(f"{p.name}: {p.nodes} nodes need distributed_executor_backend 'mp' (vLLM's nnodes), "
                        f"not {p.distributed_executor_backend!r}")
    if p.distributed_executor_backend not in EXECUTORS:
        problems.append(f"{p.name}: unknown executor {p.distributed_executor_backend!r}")
    if p.kv_cache_dtype not in KV_CACHE_DTYPES:
        problems.append(f"{p.name}: kv_cache_dtype {p.kv_cache_dtype!r} not one of {KV_CACHE_DTYPES}")
    if p.enable_expert_parallel and world == 1:
        problems.append(f"{p.name}: expert parallelism needs more than one GPU")
    if p.max_in_flight < p.max_num_seqs:
        problems.append(f"{p.name}: max_in_flight {p.max_in_flight} below max_num_seqs {p.max_num_seqs} "
                        "leaves engine slots unused")
    if p.max_num_batched_tokens is not None and not p.enable_chunked_prefill \
            and p.max_num_batched_tokens < p.max_model_len:
        problems.append(f"{p.name}: without chunked prefill max_num_batched_tokens must cover max_model_len")
    return problems
