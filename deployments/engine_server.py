"""The engine deployment: one replica = one Engine, its loop thread, a target actor and a drafter actor.

Requests enter through `generate` / `generate_stream` (called with Serve handles by the ingress, once per request);
the per-round calls from the engine to its workers are plain actor calls (deployments/actors.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from deployments.config import AppArgs, WorkerSpec, parse_args
from deployments.engine_request import EngineRequest
from deployments.errors import APIError, bad_request, internal_error, prompt_too_long, queue_full

logger = logging.getLogger(__name__)


class DDTreeEngine:
    def __init__(self, args: AppArgs | dict) -> None:
        from ddtree.engine import Engine, EngineConfig
        from deployments.actors import start_worker_actors
        from deployments.engine_loop import EngineLoop
        from deployments.metrics import EngineMetrics

        self.args = parse_args(args)
        layout = self.args.worker_layout()
        self.actors = start_worker_actors(WorkerSpec.from_args(self.args), layout.target, layout.drafter)
        config = EngineConfig(
            speculation=self.args.speculation,
            budget=self.args.budget,
            max_budget=self.args.max_budget,
            max_num_seqs=self.args.max_num_seqs,
            max_waiting=self.args.max_waiting,
            max_model_len=self.args.max_model_len,
            allow_fallback=self.args.allow_fallback,
            max_probe_overhead=self.args.max_probe_overhead,
            ngram_tokens=self.args.ngram_tokens,
            pipeline=self.args.pipeline,
        )
        target = self.actors.target_proxy
        self.engine = Engine(config, target, self.actors.drafter_proxy, target.tokenizer)
        self.metrics = EngineMetrics(self.engine, self.actors.hops, kv_cache_stats=target.kv_cache_stats)
        self.loop = EngineLoop(self.engine, on_round=self.metrics.on_round, prepare_prompt=self._prepare_prompt)
        self.loop.start()

    def _prepare_prompt(self, request: EngineRequest) -> str | list[int]:
        """The engine's prompt; chat messages through the model's chat template (runs on the loop thread)."""
        if request.messages is None:
            return request.prompt
        return chat_prompt_token_ids(self.engine.tokenizer, request.messages)

    async def generate(self, request: EngineRequest):
        """The finished `RequestOutput` of one request, or the APIError that refused it."""
        final = None
        async for final in self.generate_stream(request):
            if isinstance(final, APIError):
                break
        return final

    async def generate_stream(self, request: EngineRequest) -> AsyncIterator:
        """The request's incremental `RequestOutput`s (use with `handle.options(stream=True)`): before the last, only
        their increments (`new_text`, `new_token_ids`; `RequestOutput.increment`); the last, finished, carries
        everything (text, token_ids, stats).

        A refused request (bad input, prompt too long, queue full) yields one APIError instead of raising it: these
        are answers, not failures of the replica (Serve would log a traceback for each)."""
        try:
            async for output in self.loop.stream(request, request.params, request.request_id):
                yield output if output.finished else output.increment()
        except Exception as exc:  # noqa: BLE001 - sorted into client errors and engine failures below
            error = _as_api_error(exc, request)
            if error.status >= 500:
                logger.error("engine failure: %r", exc)
                raise error from exc
            yield error

    async def info(self) -> dict:
        """Engine settings and cumulative timings (with the actor hop overhead), read between rounds."""
        def read(engine) -> dict:
            return {
                "speculation": engine.config.speculation,
                "pipeline": engine.config.pipeline,
                "max_model_len": engine.max_model_len,
                "max_budget": engine.max_budget,
                "num_running": engine.num_running,
                "num_waiting": engine.num_waiting,
                "timings": engine.timings.as_dict(),
                "actor_hop_seconds": self.actors.hops.seconds,
                "actor_hop_calls": self.actors.hops.num_calls,
                "num_metrics_errors": self.loop.num_callback_errors,
            }

        return await self.loop.call(read)

    async def ready(self) -> bool:
        """True once this replica serves (its constructor has loaded the workers); raises if its loop stopped."""
        self.check_health()
        return True

    def check_health(self) -> None:
        if not self.loop.is_alive:
            raise RuntimeError(f"the engine loop stopped: {self.loop.error!r}")
        if self.loop.seconds_in_round > self.args.max_round_seconds:
            raise RuntimeError(f"an engine round has run for {self.loop.seconds_in_round:.0f} s (max_round_seconds "
                               f"{self.args.max_round_seconds:g}): a worker is hung")

    def __del__(self) -> None:
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop()
        actors = getattr(self, "actors", None)
        if actors is not None:
            with contextlib.suppress(Exception):
                actors.kill()


def chat_prompt_token_ids(tokenizer, messages: list[dict]) -> list[int]:
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError("each chat message must be a dict with string 'role' and 'content'")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; use /v1/completions")
    from jinja2 import TemplateError

    try:
        return list(tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    except TemplateError as exc:  # e.g. a template that refuses system messages or roles that do not alternate
        raise ValueError(f"the model's chat template refused these messages: {exc}") from exc


def _as_api_error(exc: Exception, request: EngineRequest) -> APIError:
    """The engine's admission errors as the API errors a client should see."""
    from ddtree.engine import PromptTooLongError
    from ddtree.scheduler import EngineFullError

    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, PromptTooLongError):
        return prompt_too_long(str(exc), request.prompt_param)
    if isinstance(exc, EngineFullError):
        return queue_full(str(exc))
    if isinstance(exc, ValueError):
        return bad_request(str(exc), request.prompt_param)
    return internal_error(f"engine failure: {type(exc).__name__}: {exc}")
