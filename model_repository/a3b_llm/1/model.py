"""a3b_llm: token ids in, token ids out per engine step (decoupled), via vLLM AsyncLLM."""
from a3b_backend.serving import triton

triton.use_utf8_locale()

import asyncio  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402

import triton_python_backend_utils as pb_utils  # noqa: E402
from vllm.v1.engine.exceptions import EngineDeadError  # noqa: E402

from a3b_backend import contract  # noqa: E402
from a3b_backend.engine.host import EngineHost  # noqa: E402
from a3b_backend.profiles import get_profile  # noqa: E402
from a3b_backend.serving import drain, lora, pacing, stops  # noqa: E402
from a3b_backend.serving.adapters import Adapters  # noqa: E402
from a3b_backend.serving.llm import StepTracker, parse_llm_request, request_arrays, step_arrays  # noqa: E402
from a3b_backend.serving.metrics import TritonMetrics  # noqa: E402
from a3b_backend.serving.sampling import Limits  # noqa: E402
from a3b_backend.serving.tensors import RequestError, string_value  # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
INPUT_NAMES = contract.names(contract.LLM_INPUTS)


class TritonPythonModel:
    def initialize(self, args):
        profile = get_profile()
        root = triton.project_root(args)
        self.max_in_flight = profile.max_in_flight
        self.pacing = pacing.ResponsePacing(profile.stream_responses_per_s)
        self.metrics = TritonMetrics(pb_utils, {"model": args["model_name"], "version": args["model_version"]})
        listed = lora.read_config(Path(args["model_repository"]) / args["model_version"], root)
        self.lora_work_dir = tempfile.TemporaryDirectory(prefix="a3b-lora-")
        self.adapters = Adapters.prepare(listed, profile.resolve_model_dir(root), Path(self.lora_work_dir.name),
                                         profile.max_lora_rank)
        self.host = EngineHost(
            profile.engine_args(root, enable_lora=bool(listed)),
            env=profile.engine_env(),
            stat_loggers=[self.metrics.stat_logger_factory()],
            on_state=self.metrics.engine_state,
            on_in_flight=self.metrics.in_flight,
            restart_needs=profile.restart_needs,
        )
        self.limits = Limits.from_profile(profile, vocab_size=self.host.engine.model_config.get_vocab_size())
        # for the reasoning / tool-call parsers, which run here (a3b_backend/serving/parsing.py)
        self.tokenizer = triton.load_tokenizer(args) if profile.parses_output else None
        self.cancel_polls = triton.PollSchedule()
        self.stops = stops.StopRegistry()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                tensors = triton.read_inputs(request, INPUT_NAMES)
                if contract.ABORT_REQUEST_ID in tensors:
                    self.host.submit_abort(string_value(tensors, contract.ABORT_REQUEST_ID))
                    sender.send(flags=FINAL)
                    continue
                if stops.asks_stop(tensors):
                    for engine_id in self.stops.engine_ids(stops.stop_target(request.request_id())):
                        self.host.submit_abort(engine_id)
                    sender.send(flags=FINAL)
                    continue
                refusal = drain.refusal(lambda: self.host.refusal(self.max_in_flight))
                if refusal:
                    self.metrics.rejected()
                    sender.send(triton.unavailable_response(pb_utils, refusal), flags=FINAL)
                    continue
                tracker = StepTracker(parse_llm_request(tensors, self.limits), self.tokenizer)
                lora_request = self.adapters.request(tracker.request.lora_name)
            except RequestError as exc:
                sender.send(triton.error_response(pb_utils, str(exc)), flags=FINAL)
                continue
            request_id = uuid.uuid4().hex
            self.stops.add(request.request_id(), request_id)
            self.host.submit(
                request_id, self._serve(request_id, request.request_id(), sender, tracker, lora_request,
                                        string_value(tensors, contract.POSTPROCESS_CONFIG))
            )
        return None

    async def _serve(self, request_id: str, client_id: str, sender, tracker: StepTracker, lora_request,
                     postprocess_config: str):
        llm_request = tracker.request
        per_request = request_arrays(postprocess_config, request_id)
        sent_final = False
        quiet = triton.QuietStreamWatch(sender.is_cancelled, lambda: self.host.abort(request_id))
        watch = asyncio.ensure_future(quiet.run())
        try:
            outputs = self.host.generate(request_id, llm_request.prompt_ids, llm_request.sampling_params(),
                                         lora_request)
            async for output in pacing.paced(outputs, self.pacing, lambda: self.host.in_flight):
                quiet.output()
                if self.cancel_polls.due(request_id, time.monotonic()) and sender.is_cancelled():
                    await self.host.abort(request_id)
                    break
                step = tracker.step(output)
                sender.send(triton.response(pb_utils, step_arrays(step, per_request)),
                            flags=FINAL if step.final else 0)
                sent_final = step.final
        except EngineDeadError as exc:
            sender.send(triton.unavailable_response(pb_utils, f"engine failed ({exc}); restarting, retry"),
                        flags=FINAL)
            sent_final = True
            self.host.restart_if_dead()
        except asyncio.CancelledError:
            # finalize() gave up waiting: the server is stopping with this stream unfinished.
            sender.send(triton.unavailable_response(pb_utils, "server shut down before the generation finished; "
                                                                 "retry on another replica"), flags=FINAL)
            sent_final = True
            raise
        except Exception as exc:  # one request's failure must not touch the others
            sender.send(triton.error_response(pb_utils, f"generation failed: {exc}", invalid_argument=False),
                        flags=FINAL)
            sent_final = True
        finally:
            watch.cancel()
            self.stops.discard(client_id, request_id)
            if not sent_final:
                sender.send(flags=FINAL)

    def finalize(self):
        self.host.shutdown()
        self.metrics.release()
        self.lora_work_dir.cleanup()
