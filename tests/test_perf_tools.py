"""perf/ tooling logic: exact-length inputs, their validity for perf_analyzer, the report maths."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from a3b_backend import contract
from a3b_backend.bench import perf_analyzer, perf_inputs, perf_report
from a3b_backend.bench.perf_inputs import Corpus, InputError
from a3b_backend.profiles import PROFILES, PROJECT_ROOT


PY_TYPES = {"STRING": str, "BOOL": bool, "INT32": int, "UINT64": int, "FP32": float}
ENSEMBLE_INPUTS = {t.name: t for t in contract.TEXT_INPUTS}


@pytest.fixture(scope="module")
def smollm_corpus(tokenizer):
    return Corpus(perf_inputs.HFTokenizer(tokenizer))


@pytest.fixture(scope="module")
def qwen_corpus():
    return Corpus(perf_inputs.QwenTokenizer.load())


def assert_valid_entry(entry: dict) -> None:
    """What perf_analyzer needs of a data entry for our [1]-shaped ensemble inputs."""
    for name, values in entry.items():
        assert name in ENSEMBLE_INPUTS, f"{name} is not an ensemble input"
        spec = ENSEMBLE_INPUTS[name]
        assert spec.dims == (1,) and isinstance(values, list) and len(values) == 1, name
        assert type(values[0]) is PY_TYPES[spec.dtype], (name, values)
    assert "text_input" in entry


@pytest.mark.parametrize("flavour", perf_inputs.FLAVOURS)
def test_cpu_plan_prompts_have_exact_token_counts(smollm_corpus, tokenizer, flavour):
    profile = PROFILES["cpu"]
    for length in profile.perf.prompt_lengths:
        data = perf_inputs.fixed_length_data(smollm_corpus, profile, length, 32, flavour, count=3)
        json.dumps(data)
        prompts = [e["text_input"][0] for e in data["data"]]
        assert len(set(prompts)) == 3, "each prompt starts at its own offset"
        for entry, prompt in zip(data["data"], prompts):
            assert_valid_entry(entry)
            assert len(tokenizer.encode(prompt, add_special_tokens=True)) == length
            assert sum(c.isalpha() for c in prompt) > len(prompt) / 2, "natural-language text"


def test_gpu_plan_prompts_are_exact_under_the_qwen_vocabulary(qwen_corpus):
    profile = PROFILES["h200"]
    tok = qwen_corpus.tokenizer
    for length in profile.perf.prompt_lengths:
        data = perf_inputs.fixed_length_data(qwen_corpus, profile, length, profile.perf.output_tokens, "vllm", 1)
        assert len(tok.encode(data["data"][0]["text_input"][0])) == length
    assert max(profile.perf.prompt_lengths) > 128_000  # the 128K case wraps the corpus ring


def test_rag_mix_shares_the_document_prefix(qwen_corpus):
    profile = PROFILES["h200"]
    data = perf_inputs.rag_data(qwen_corpus, profile, profile.perf.rag_document_tokens, 256, "trtllm", 4)
    prompts = [e["text_input"][0] for e in data["data"]]
    assert len(set(prompts)) == 4
    document = prompts[0].split("\n\nQuestion:")[0]
    assert all(p.startswith(document) for p in prompts) and document.startswith(perf_inputs.RAG_SYSTEM_PROMPT)
    assert len(qwen_corpus.tokenizer.encode(document)) >= profile.perf.rag_document_tokens
    for entry in data["data"]:
        assert_valid_entry(entry)
        assert entry["max_tokens"] == entry["min_tokens"] == [256]


def test_generator_refuses_a_prompt_over_the_context(qwen_corpus):
    profile = PROFILES["h200"]
    with pytest.raises(InputError, match=r"131072 \+ 256 output tokens exceeds profile 'h200' context of 131072"):
        perf_inputs.fixed_length_data(qwen_corpus, profile, 131072, 256, "vllm", 1)
    with pytest.raises(SystemExit, match="the longest prompt it can take is 8160"):
        perf_inputs.main(["--profile", "cpu", "--out", "/nonexistent", "--length", "9000"])


def test_generator_cli_writes_every_file(tmp_path):
    perf_inputs.main(["--profile", "cpu", "--out", str(tmp_path), "--length", "128", "--flavour", "vllm"])
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["len128_vllm.json", f"rag{PROFILES['cpu'].perf.rag_document_tokens}_vllm.json"]
    for path in tmp_path.iterdir():
        for entry in json.loads(path.read_text())["data"]:
            assert_valid_entry(entry)


def _export(requests: list[dict]) -> dict:
    return {"experiments": [{"experiment": {"mode": "concurrency", "value": 2}, "requests": requests,
                             "window_boundaries": [0, 10]}], "version": "x"}


def test_report_metrics_from_a_perf_analyzer_export():
    ms = 1_000_000
    text = lambda s: {"text_output": s}  # noqa: E731
    requests = [
        # TTFT 100 ms, then 3 more tokens 10 ms apart, then an empty final response
        {"timestamp": 0, "response_timestamps": [100 * ms, 110 * ms, 120 * ms, 130 * ms, 131 * ms],
         "response_outputs": [text("a"), text("b"), text("c"), text("d"), {}]},
        {"timestamp": 50 * ms, "response_timestamps": [250 * ms, 290 * ms],
         "response_outputs": [text("ab"), text("cd")]},
    ]
    [level] = perf_report.records_from_export(_export(requests))
    summary = perf_report.summarize(level, count_tokens=len)
    assert summary.requests == 2 and summary.errors == 0
    assert summary.ttft_ms[50] == pytest.approx(150.0)
    assert summary.e2e_ms[99] == pytest.approx(130 + (240 - 130) * 0.99)
    # request 1: 30 ms over 3 gaps; request 2: 40 ms over 3 gaps (4 tokens)
    assert summary.itl_ms[50] == pytest.approx((10 + 40 / 3) / 2)
    assert summary.output_tokens_per_s == pytest.approx(8 / 0.290)
    assert summary.requests_per_s == pytest.approx(2 / 0.290)
    table = perf_report.markdown_table([summary])
    assert table.count("\n") == 3 and "concurrency 2" in table


def test_report_reads_length_prefixed_bytes_outputs():
    assert perf_report.bytes_text(b"\x05\x00\x00\x00hello") == "hello"
    assert perf_report.bytes_text("plain") == "plain"


def test_report_counts_failed_requests_apart():
    level = perf_report.LoadLevel("concurrency 1", "x", [
        perf_report.RequestRecord(0, [1_000_000], ["hi"]),
        perf_report.RequestRecord(0, [], [], error="server busy: ... retry later"),
    ])
    summary = perf_report.summarize(level, count_tokens=len)
    assert (summary.requests, summary.errors) == (1, 1)
    assert dataclasses.asdict(summary)["ttft_ms"][50] == pytest.approx(1.0)


def test_perf_plans_stream_with_count_windows_and_never_repeat_a_prompt(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_perf", Path(__file__).parent.parent / "perf" / "run_perf.py")
    run_perf = importlib.util.module_from_spec(spec)
    sys.modules["run_perf"] = run_perf  # its dataclass looks itself up there
    spec.loader.exec_module(run_perf)
    for name in ("cpu", "h200"):
        profile = PROFILES[name]
        plan = run_perf.runs(profile)
        for run in plan:
            args = run_perf.perf_analyzer_args(profile, run, tmp_path / "in.json")
            assert {"--streaming", "--async", "count_windows"} <= set(args), run.stem
            command = perf_analyzer.command(args, tmp_path / f"{run.stem}.json")
            assert command[command.index("--profile-export-file") + 1] == str(tmp_path / f"{run.stem}.json")
        assert sum("_trtllm" in run.stem for run in plan) == len(profile.perf.concurrencies)
        assert all(any(f"len{n}_vllm" in run.stem for run in plan) for n in profile.perf.prompt_lengths)
        for input_name in {run.input_name for run in plan}:
            assert sum(r.requests for r in plan if r.input_name == input_name) <= profile.perf.prompts_per_file
    rate = [run for run in run_perf.runs(PROFILES["h200"]) if "rate" in run.stem]
    assert rate and rate[0].load == ["--request-rate-range", f"{200 / 60:.4f}"]
    # each run starts past the prompts the runs before it used
    cpu = [r for r in run_perf.runs(PROFILES["cpu"]) if r.input_name == "len128_vllm.json"]
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    (inputs / "len128_vllm.json").write_text(json.dumps({"data": [{"text_input": [str(i)]} for i in range(23)]}))
    files = run_perf.run_inputs(cpu, inputs, tmp_path)
    firsts = [json.loads(files[r.stem].read_text())["data"][0]["text_input"][0] for r in cpu]
    assert firsts == ["0", str(cpu[0].requests)]
    # --resume keeps only whole exports
    whole = tmp_path / "whole.json"
    whole.write_text(json.dumps(_export([{"timestamp": 0, "response_timestamps": [1], "response_outputs": [{}]}])))
    cut = tmp_path / "cut.json"
    cut.write_text(whole.read_text()[:40])
    assert run_perf.exported(whole) and not run_perf.exported(cut) and not run_perf.exported(tmp_path / "none.json")


def test_gpu_kernel_benchmark_reports_tables_goals_and_a_plot(tmp_path):
    """perf/gpu_kernels.py's report on synthetic timings (the timing itself needs a GPU)."""
    sys.path.insert(0, str(PROJECT_ROOT / "perf"))
    import gpu_kernels as bench

    rows = [bench.Timing("linear", "8192x8192 M=1", "bf16 cuBLAS", 30.0, 8192 * 8192 * 2),
            bench.Timing("linear", "8192x8192 M=1", "torch int4", 12.0, 8192 * 8192 // 2),
            bench.Timing("linear", "8192x8192 M=1", "A3B Triton", 9.0, 36_000_000),
            bench.Timing("linear", "8192x8192 M=4", "torch int4", None, 0, "RuntimeError: no kernel"),
            bench.Timing("attention", "ctx=131072", "A3B Triton", 80.0, 73_400_320),
            bench.Timing("attention", "ctx=131072", "fp16 SDPA", 200.0, 268_435_456)]
    checked = [("triton a3b_matmul M=1", 1e-6, True)]
    bench.write_report(tmp_path, rows, 4000.0, "test GPU", checked, ["8192x8192: extra 0 B"])
    md = (tmp_path / "gpu_kernels.md").read_text()
    assert "# A3B kernels on test GPU" in md and "| 8192x8192 M=1 | A3B Triton | 9.0 | 4000 | 100% |" in md
    assert "3.33x faster than bf16 cuBLAS (goal >= 3x: met)" in md
    assert "8192x8192 M=1: A3B 9.0 us vs torch int4 12.0 us (faster)" in md
    assert "RuntimeError: no kernel" in md
    assert (tmp_path / "gpu_kernels.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "gpu_kernels.json").read_text())["timings"][2]["gbps"] == 4000.0


def test_gpu_kernel_benchmark_says_why_it_cannot_run_without_a_gpu(capsys):
    sys.path.insert(0, str(PROJECT_ROOT / "perf"))
    import gpu_kernels as bench

    assert bench.main([]) == 2
    assert "needs a CUDA GPU and torch with CUDA" in capsys.readouterr().err


def test_server_cpu_is_counted_by_process_name():
    from a3b_backend.bench import server_process

    stub = ["/opt/tritonserver/backends/python/triton_python_backend_stub",
            "/tmp/repo/postprocessing/1/model.py", "triton_python_backend_shm_region_3", "1048576"]
    assert server_process.process_name(stub) == "postprocessing"
    assert server_process.process_name(["VLLM::EngineCore"]) == "VLLM::EngineCore"
    server = ["/opt/tritonserver/bin/tritonserver", "--model-repository", "x"]
    assert server_process.process_name(server) == "tritonserver"
    assert server_process.ENGINE_PROCESS.match("VLLM::Worker") and not server_process.ENGINE_PROCESS.match("a3b_llm")


def test_gpu_profile_script_says_why_it_cannot_run_without_a_gpu(capsys):
    sys.path.insert(0, str(PROJECT_ROOT / "perf"))
    import profile_gpu_kernels

    assert profile_gpu_kernels.main([]) == 2
    assert "needs a CUDA GPU and torch with CUDA" in capsys.readouterr().err


def test_gpu_kernel_benchmark_smoke_run_passes_every_code_path(tmp_path):
    """The whole script on the CPU at tiny sizes (Triton's interpreter), so the
    first GPU session does not spend its minutes on a broken script."""
    done = subprocess.run([sys.executable, str(PROJECT_ROOT / "perf" / "gpu_kernels.py"), "--smoke", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    md = (tmp_path / "gpu_kernels.md").read_text()
    assert md.count("| yes |") == 7 and "| NO |" not in md  # matmul x3, its table kernel at M=1, MoE, KV, attention
    for variant in ("bf16 cuBLAS", "torch int4", "A3B Triton", "fp16 SDPA"):
        assert f"| {variant} |" in md


def test_aiperf_template_renders_the_generate_stream_body():
    """AIPerf renders perf/inputs/aiperf_generate_stream.jinja with autoescaping on: the body
    must stay valid JSON for any prompt and carry the sampling parameters as a JSON string."""
    import jinja2

    template = (PROJECT_ROOT / "perf" / "inputs" / "aiperf_generate_stream.jinja").read_text()
    prompt = 'She said "<b>hi</b>" & left\n北京 🎉'
    body = json.loads(jinja2.Environment(autoescape=True).from_string(template).render(text=prompt, max_tokens=24))
    assert body["text_input"] == prompt and body["stream"] is True and body["exclude_input_in_output"] is True
    assert json.loads(body["sampling_parameters"]) == {"max_tokens": 24, "ignore_eos": True}


def test_aiperf_report_sets_the_tools_side_by_side(tmp_path):
    sys.path.insert(0, str(PROJECT_ROOT / "perf"))
    import aiperf as bench

    summary = {key: {"unit": "ms", "avg": 100.0 * i, "p50": 90.0 * i, "p99": 150.0 * i}
               for i, (key, _) in enumerate(bench.METRICS, 1)}
    rows = bench.comparison({"genai-perf": summary, "AIPerf": summary})
    args = bench.argparse.Namespace(isl=64, osl=16, concurrency=2, requests=10, tokenizer=tmp_path, http_url="h",
                                    grpc_url="g", out=tmp_path)
    report = bench.write_report(tmp_path, rows, args, ["genai-perf", "AIPerf"]).read_text()
    assert "| TTFT p50 (ms) | 90.0 | 90.0 |" in report and "| ITL p99 (ms) | 300.0 | 300.0 |" in report
    assert (tmp_path / "aiperf_vs_genai_perf.png").stat().st_size > 10_000


def test_perf_analyzer_runs_again_when_its_export_is_cut_short(tmp_path, monkeypatch):
    """A stand-in for scripts/perf_analyzer.sh: refuses an existing export as perf_analyzer does,
    writes a cut-short export the first time and a whole one the second."""
    script = tmp_path / "perf_analyzer.sh"
    script.write_text('export="${@: -1}"; [[ -e "$export" ]] && exit 1\n'
                      'if [[ -e "$0.ran" ]]; then echo \'{"experiments": []}\' > "$export"; '
                      'else touch "$0.ran"; printf \'{"experi\' > "$export"; fi\n')
    monkeypatch.setattr(perf_analyzer, "SCRIPT", script)
    export = tmp_path / "out.json"
    export.write_text("stale")
    assert perf_analyzer.run(["-m", "ensemble"], export, tmp_path / "log") == {"experiments": []}


def test_serving_cpu_splits_the_ensembles_cost_into_per_response_and_per_token(monkeypatch):
    monkeypatch.syspath_prepend(str(PROJECT_ROOT / "perf"))
    import serving_cpu

    def run(responses_per_request: int) -> serving_cpu.Measured:
        requests, tokens = 24, 24 * 32
        responses = requests * responses_per_request
        # 0.9 ms per response and 0.3 ms per token, spread over two serving processes; the engine's is left out
        serving = 0.9 * responses + 0.3 * tokens
        cpu = {"tritonserver": serving / 2, "a3b_llm": serving / 2, "VLLM::EngineCore": 5000.0}
        return serving_cpu.Measured("ensemble", cpu, tokens=tokens, responses=responses, requests=requests)

    per_response, per_token = serving_cpu.split_cost([run(32), run(9), run(2)])
    assert per_response == pytest.approx(0.9) and per_token == pytest.approx(0.3)
    assert run(32).serving_ms() / (24 * 32) == pytest.approx(1.2)


def test_overhead_report_says_which_goals_a_run_met():
    """perf/overhead.py's verdicts on synthetic intervals: only the ensemble's rows at the goals' concurrencies."""
    sys.path.insert(0, str(PROJECT_ROOT / "perf"))
    import overhead

    def row(variant, concurrency, itl_high, ttft_high):
        return dict(variant=variant.name, concurrency=concurrency,
                    itl_vs_a_percent={"mean": 0.0, "low": -1.0, "high": itl_high},
                    ttft_vs_a_percent={"mean": 0.0, "low": -1.0, "high": ttft_high})

    rows = [row(overhead.ENSEMBLE, 1, 9.0, 9.0), row(overhead.ENSEMBLE, 8, 3.0, 5.1),
            row(overhead.VARIANTS[1], 32, 9.0, 9.0), row(overhead.ENSEMBLE, 32, 3.1, -2.0)]
    assert overhead.goal_verdicts(rows) == [
        "concurrency 8, inter-token: +0.0 [-1.0, +3.0] %, upper end at most +3: met",
        "concurrency 8, TTFT: +0.0 [-1.0, +5.1] %, upper end at most +5: missed",
        "concurrency 32, inter-token: +0.0 [-1.0, +3.1] %, upper end at most +3: missed",
        "concurrency 32, TTFT: +0.0 [-1.0, -2.0] %, upper end at most +5: met"]


def test_engine_run_queue_wait_is_read_by_vllm_process_title():
    import psutil

    from a3b_backend.bench import server_process

    worker = subprocess.Popen(["bash", "-c", 'exec -a "VLLM::Worker" sleep 30'])
    try:
        for _ in range(100):  # until exec has retitled it
            if psutil.Process(worker.pid).cmdline()[:1] == ["VLLM::Worker"]:
                break
            time.sleep(0.05)
        waited = server_process.engine_run_queue_wait_s(psutil.Process(worker.pid))
        assert set(waited) == {"VLLM::Worker"} and waited["VLLM::Worker"] >= 0
    finally:
        worker.kill()
        worker.wait()


def test_overhead_over_runs_holds_the_spread_between_runs(tmp_path):
    """perf/overhead_runs.py: each run's interval as its own report gives it, and a pooled interval
    that spans runs whose means differ, however narrow each run's own interval is."""
    sys.path.insert(0, str(PROJECT_ROOT / "perf"))
    import overhead
    import overhead_runs

    rng = np.random.default_rng(1)
    steady, shifted = rng.normal(0.0, 0.1, 48), rng.normal(10.0, 0.1, 24)
    pooled = overhead_runs.two_level_percent([steady, shifted])
    assert pooled["mean"] == pytest.approx(5.0, abs=0.1)
    assert pooled["low"] < 1.0 and pooled["high"] > 9.0
    same = overhead_runs.two_level_percent([np.full(8, 2.0), np.full(12, 2.0)])
    assert same == pytest.approx({"mean": 2.0, "low": 2.0, "high": 2.0})

    def write_run(name: str, itl_factor: float, machine: str = "Some CPU, 2 cores") -> Path:
        rows = [dict(variant=v.name, concurrency=c, round_itl_ms=[100.0 * f] * 4, round_ttft_ms=[1000.0] * 4)
                for c in overhead.GOAL_CONCURRENCY for v, f in ((overhead.BARE, 1.0), (overhead.ENSEMBLE, itl_factor))]
        run = tmp_path / name
        run.mkdir()
        (run / "overhead.json").write_text(json.dumps(rows))
        (run / "overhead.md").write_text(f"Machine: {machine}. Command: `x`.")
        return run

    changes = overhead_runs.round_changes(json.loads((write_run("a", 1.02) / "overhead.json").read_text()),
                                          "round_itl_ms", 8)
    assert changes == pytest.approx([2.0] * 4)
    overhead_runs.main([str(tmp_path / "a"), str(write_run("b", 1.06)), "--out", str(tmp_path / "out")])
    report = (tmp_path / "out" / "overhead_runs.md").read_text()
    assert "| a | Some CPU, 2 cores | 4/4 | +2.0 [+2.0, +2.0] | +2.0 [+2.0, +2.0] |" in report
    assert "- all runs: concurrency 8, inter-token: +4.0 [+2.0, +6.0] %, upper end at most +3: missed" in report
    assert "- all runs: concurrency 32, TTFT: +0.0 [+0.0, +0.0] %, upper end at most +5: met" in report
    assert (tmp_path / "out" / "overhead_runs.png").stat().st_size > 0
    with pytest.raises(SystemExit):  # runs of two machines are not pooled
        overhead_runs.main([str(tmp_path / "a"), str(write_run("c", 1.0, "Other CPU, 16 cores"))])


def test_gpu_time_estimate_counts_kernels_by_their_bound():
    """A matmul is FLOP-bound, a large copy byte-bound, a tiny op launch-bound, a view free and a
    boolean mask a sync."""
    sys.path.insert(0, str(PROJECT_ROOT / "perf"))
    import torch
    from convert_scale import GpuHost, GpuTimeEstimate

    host = GpuHost()
    a, b, big, tiny = torch.randn(512, 512), torch.randn(512, 512), torch.randn(2**22), torch.randn(4)
    with GpuTimeEstimate(host) as counted:
        a @ b
    assert counted.seconds() == pytest.approx(max(host.kernel_s, 2 * 512**3 / host.flops, 3 * 512**2 * 4 /
                                                  host.bytes_per_s))
    with GpuTimeEstimate(host) as counted:
        big.clone()
        tiny.view(2, 2)
        tiny + 1
        tiny[tiny > 0]
    assert counted.summary()["kernels"] == 4  # clone, add, gt, the masked index; the view is free
    assert counted.summary()["syncs"] == 1
    assert counted.seconds() == pytest.approx(2 * big.numel() * 4 / host.bytes_per_s + 2 * host.kernel_s
                                              + host.sync_s)
    assert counted.seconds(scale=2) > counted.seconds()
