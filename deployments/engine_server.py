"""The engine deployment: one replica = one Engine, its loop thread, a target actor and a drafter actor.

Requests enter through `generate` / `generate_stream` (called with Serve handles by the ingress, once per request);
the per-round calls from the engine to its workers are plain actor calls (deployments/actors.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import os
import sys
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from ddtree.detokenizer import Detokenizer
from deployments.config import AppArgs, WorkerSpec, parse_args
from deployments.engine_request import EngineRequest
from deployments.errors import (
    APIError,
    bad_request,
    engine_unavailable,
    internal_error,
    prompt_too_long,
    queue_full,
    queue_timeout,
)

logger = logging.getLogger(__name__)


class DDTreeEngine:
    def __init__(self, args: AppArgs | dict) -> None:
        from ddtree.engine import Engine
        from deployments.actors import start_worker_actors
        from deployments.engine_loop import EngineLoop
        from deployments.metrics import EngineMetrics

        self.args = parse_args(args)
        if self.args.gil_switch_interval_ms is not None:  # (the whole replica process: its threads share one GIL)
            sys.setswitchinterval(self.args.gil_switch_interval_ms / 1000)
        layout = self.args.worker_layout()
        self.actors = start_worker_actors(WorkerSpec.from_args(self.args), layout.target, layout.drafter)
        config = self.args.engine_config()
        target = self.actors.target_proxy
        # Texts without stop strings are decoded by their streams, on the event loop, off the round's path
        self.engine = Engine(config, target, self.actors.drafter_proxy, target.tokenizer, detokenize=False)
        self.metrics = EngineMetrics(
            self.engine, self.actors.hops, kv_cache_stats=lambda: self.actors.target_proxy.kv_cache_stats()
        )
        # Prompts are tokenized (chat templates rendered) here, off the loop thread, by a tokenizer of their own
        # (the loop's detokenizes at the same time): a long prompt delays itself, not every running request's
        # next round (the Rust tokenizer releases the GIL while it encodes). One thread: prompts in arrival order.
        self._prompt_tokenizer = copy.deepcopy(target.tokenizer)
        self._prompt_pool = ThreadPoolExecutor(1, thread_name_prefix="ddtree-prompts")
        # A prompt of more characters than the window holds tokens of the longest token is refused untokenized.
        self._max_prompt_chars = self.engine.max_model_len * longest_token_chars(self._prompt_tokenizer)
        self.loop = EngineLoop(
            self.engine,
            on_round=self.metrics.on_round,
            on_idle=self.metrics.on_idle,
            detokenizer=Detokenizer(copy.deepcopy(target.tokenizer)),
            max_chunks_per_s=self.args.max_stream_chunks_per_s,
            nice=self.args.round_nice,
        )
        self.loop.start()
        self._drafter_restart: asyncio.Task | None = None  # a new drafter actor loading
        self._next_drafter_restart = 0.0  # (monotonic) after a failed restart: when to try again
        self._num_failed_drafter_restarts = 0
        self._workers_restart: asyncio.Task | None = None  # a new target (and drafter) actor loading
        self._workers_restart_error: str | None = None  # it failed: the replica is unhealthy

    async def _prompt_token_ids(self, request: EngineRequest) -> list[int]:
        """The request's prompt as token ids, checked against the context window; chat messages through the
        model's chat template."""
        from ddtree.engine import PromptTooLongError

        if request.prompt is not None and not isinstance(request.prompt, str):
            token_ids = request.prompt  # the engine checks them
        else:
            texts = (
                [request.prompt]
                if request.messages is None
                else [m.get("content") for m in request.messages if isinstance(m, dict)]
            )
            texts = [t for t in texts if isinstance(t, str)]  # (the template refuses other messages, below)
            num_chars = sum(len(t) for t in texts)
            for text in texts:
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as exc:  # a lone UTF-16 surrogate: JSON's "\ud800" parses into one
                    raise ValueError(
                        f"the prompt is not valid Unicode text: {exc.reason} at character {exc.start}"
                    ) from None
            if num_chars > self._max_prompt_chars:
                raise PromptTooLongError(
                    f"the prompt has {num_chars} characters: more tokens than the context window "
                    f"({self.engine.max_model_len}) holds"
                )
            token_ids = await asyncio.get_running_loop().run_in_executor(self._prompt_pool, self._encode, request)
        params = request.params
        if request.strict_max_tokens and len(token_ids) + params.max_tokens > self.engine.max_model_len:
            raise PromptTooLongError(
                f"this model's context window is {self.engine.max_model_len} tokens; the request asks for "
                f"{len(token_ids) + params.max_tokens} ({len(token_ids)} in the prompt, {params.max_tokens} to "
                f"generate): lower max_tokens or shorten the prompt"
            )
        return token_ids

    def _encode(self, request: EngineRequest) -> list[int]:
        from ddtree.request import encode_prompt

        if request.messages is not None:
            return chat_prompt_token_ids(self._prompt_tokenizer, request.messages)
        return encode_prompt(self._prompt_tokenizer, request.prompt)

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
            prompt_token_ids = await self._prompt_token_ids(request)
            async for output in self.loop.stream(
                prompt_token_ids, request.params, request.request_id, interval_s=self.args.stream_interval_ms / 1000
            ):
                if output.finish_reason == "queue_timeout":  # (its only output: it was never admitted)
                    yield queue_timeout(
                        f"the request waited {self.args.max_queue_seconds:g} s (max_queue_seconds) "
                        f"without a seat in the engine; retry later"
                    )
                    return
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
                "num_generated_tokens": self.metrics.num_generated_tokens,  # output tokens emitted so far
                "actor_hop_seconds": self.actors.hops.seconds,
                "actor_hop_calls": self.actors.hops.num_calls,
                "actor_hop_there_seconds": self.actors.hops.there_seconds,
                # per operation (Verify, Draft, Allocate, ...): [calls, seconds there, seconds back, of them waiting]
                "actor_hops_by_op": {op: list(v) for op, v in self.actors.hops.by_op.items()},
                "num_metrics_errors": self.loop.num_callback_errors,
                # a lost drafter (None: live, or speculation off); losses so far and drafter actors restarted
                "drafter_lost": engine.drafter_lost,
                "num_drafter_losses": engine.num_drafter_losses,
                "num_drafter_restarts": self.actors.num_drafter_restarts,
                # a lost target (None: live); losses so far and target actors restarted (its requests prefilled
                # again on the new one)
                "target_lost": engine.target_lost,
                "num_target_losses": engine.num_target_losses,
                "num_target_restarts": self.actors.num_target_restarts,
                "pid": os.getpid(),  # the replica's process
                "gil_switch_interval_s": sys.getswitchinterval(),
                "worker_pids": {
                    "target": self.actors.target_proxy.pid,
                    "drafter": getattr(self.actors.drafter_proxy, "pid", None),
                },
                # the closed loop's measurements per batch-size bucket (auto budget; None otherwise)
                "guard": engine.guard.describe() if engine.guard is not None else None,
            }

        state = await self.loop.call(read)
        # what leaks would show (each 0 or flat once the replica is idle), read off the loop thread
        state["kv_cache_bytes_used"] = None
        with contextlib.suppress(Exception):  # (a dead target, being replaced: None)
            state["kv_cache_bytes_used"] = (await self.actors.target.kv_cache_stats.remote())["bytes_used"]
        drafter = self.actors.drafter
        state["num_drafter_contexts"] = None
        if drafter is not None and state["drafter_lost"] is None:
            with contextlib.suppress(Exception):  # (a dead drafter, being replaced: None)
                state["num_drafter_contexts"] = await drafter.num_contexts.remote()
        state["num_threads"] = threading.active_count()
        state["num_asyncio_tasks"] = len(asyncio.all_tasks())
        return state

    async def ready(self) -> bool:
        """True once this replica serves (its constructor has loaded the workers); raises if it is unhealthy."""
        await self.check_health()
        return True

    async def check_health(self) -> None:
        """Fails (and Serve replaces the replica) when the engine loop stopped, a round has run past
        `max_round_seconds` (a hung worker), or a target actor that died could not be replaced. The last two give
        up on the engine first: its requests fail now (503, retriable), so that stopping the replica does not wait
        for them (graceful_shutdown_timeout_s).

        A dead target actor is not a failure by itself: its requests wait (no round runs), this check starts a new
        target actor and a new drafter actor in the old ones' bundles, and once they have loaded every running
        request is prefilled again from its prompt and committed tokens and goes on (`Engine.attach_target`).

        A dead drafter actor is not a failure either: the engine decodes on without drafts (its running requests
        lose nothing), and this check starts a new drafter actor in the old one's bundle; once it has loaded, the
        engine drafts with it again (requests admitted from the loss on; those running at the loss lost their
        drafter context and decode plain to their end)."""
        from deployments.engine_loop import EngineDeadError

        if not self.loop.is_alive:  # (its requests have failed already; abandoning again refuses new ones too)
            problem = f"the engine loop stopped: {self.loop.error!r}"
        elif self.loop.seconds_in_round > self.args.max_round_seconds:
            problem = (
                f"an engine round has run for {self.loop.seconds_in_round:.0f} s (max_round_seconds "
                f"{self.args.max_round_seconds:g}): a worker is hung"
            )
        else:
            problem = self._workers_restart_error
        if problem is not None:
            logger.error("engine replica unhealthy: %s; failing its requests", problem)
            self.loop.abandon(EngineDeadError(problem))
            raise RuntimeError(problem)
        if await self._recover_target():
            return  # (the drafter is replaced with it)
        if self.actors.drafter is not None:
            await self._recover_drafter()

    async def _recover_target(self) -> bool:
        """Start a new target actor (and drafter actor) when the engine lost its target, or the target actor died
        unnoticed (no round since); True while one is starting. If it fails to start, the engine's requests fail
        with a retriable error and the replica with them (the next check)."""
        from ddtree.workers import WorkerLostError

        if self._workers_restart is not None and not self._workers_restart.done():
            return True
        if self.engine.target_lost is None:  # (a str set on the loop thread: reading it here is safe)
            dead = await self.actors.find_dead(names=("target",))
            if dead is None:
                return False
            await self.loop.call(lambda engine: engine.lose_target(WorkerLostError(dead)))
        if self._drafter_restart is not None and not self._drafter_restart.done():
            await self._drafter_restart  # (a drafter for the dead target: replaced below)
        self._workers_restart = asyncio.ensure_future(self._restart_workers())
        return True

    async def _restart_workers(self) -> None:
        import time

        logger.warning("starting a new target actor: %d requests wait for it", len(self.engine.requests))
        t0 = time.monotonic()
        try:
            # (a start that takes longer than a round may is as hung as that round)
            fresh = await asyncio.to_thread(self.actors.start_workers, self.args.max_round_seconds)
        except Exception as exc:  # noqa: BLE001 - the requests fail retriably, then the replica (check_health)
            self._give_up_on_target(f"the target actor died and a new one failed to start: {exc!r}")
            return

        def install(engine) -> None:
            self.actors.install_workers(fresh)
            engine.attach_target(fresh.target_proxy, fresh.drafter_proxy)

        try:
            await self.loop.call(install)
        except Exception as exc:  # noqa: BLE001 - as a failed start
            self._give_up_on_target(f"the target actor died and a new one could not be attached: {exc!r}")
            return
        logger.warning(
            "a new target actor serves (started in %.1f s); its requests are prefilled again", time.monotonic() - t0
        )

    async def _recover_drafter(self) -> None:
        """Start a new drafter actor when the engine lost its drafter, or the drafter actor died unnoticed (no
        request drafted since); failed starts are retried with a growing wait (5 s, 10 s, ... up to 60 s)."""
        import time

        from ddtree.workers import WorkerLostError

        if self._drafter_restart is not None and not self._drafter_restart.done():
            return
        if self.engine.drafter_lost is None:  # (a str set on the loop thread: reading it here is safe)
            dead = await self.actors.find_dead(names=("drafter",))
            if dead is None:
                return

            def lose(engine) -> None:  # on the loop thread, the proxies' one user
                self.actors.target_proxy.drafter_lost()
                engine.lose_drafter(WorkerLostError(dead))

            await self.loop.call(lose)
        if time.monotonic() >= self._next_drafter_restart:
            self._drafter_restart = asyncio.ensure_future(self._restart_drafter())

    async def _restart_drafter(self) -> None:
        import time

        logger.warning("starting a new drafter actor (the engine decodes without drafts meanwhile)")
        t0 = time.monotonic()
        try:
            actor, proxy = await asyncio.to_thread(self.actors.start_drafter)
        except Exception as exc:  # noqa: BLE001 - the engine serves on without it; the next checks retry
            self._num_failed_drafter_restarts += 1
            wait = min(60.0, 5.0 * 2 ** (self._num_failed_drafter_restarts - 1))
            self._next_drafter_restart = time.monotonic() + wait
            logger.error("a new drafter actor failed to start (%r); retrying in %.0f s", exc, wait)
            return

        def install(engine) -> None:
            self.actors.install_drafter(actor, proxy)
            engine.attach_drafter(proxy)

        await self.loop.call(install)
        self._num_failed_drafter_restarts = 0
        logger.warning("a new drafter actor is drafting (started in %.1f s)", time.monotonic() - t0)

    def _give_up_on_target(self, problem: str) -> None:
        """No new target: the requests fail now (503, retriable), and the next health check fails the replica."""
        from deployments.engine_loop import EngineDeadError

        self._workers_restart_error = problem
        logger.error("%s; failing the engine's requests", problem)
        self.loop.abandon(EngineDeadError(problem))

    def __del__(self) -> None:
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop()
        pool = getattr(self, "_prompt_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        actors = getattr(self, "actors", None)
        if actors is not None:
            with contextlib.suppress(Exception):
                actors.kill()


def longest_token_chars(tokenizer) -> int:
    """The most characters one token of the vocabulary covers (a byte-level token's string has one character per
    byte, so its length bounds the text it decodes to; added tokens are spelled out)."""
    return max(1, max((len(t) for t in tokenizer.get_vocab()), default=1))


def chat_prompt_token_ids(tokenizer, messages: list[dict]) -> list[int]:
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError("each chat message must be a dict with string 'role' and 'content'")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; use /v1/completions")
    from jinja2 import TemplateError

    try:
        return list(
            tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True, return_dict=False)
        )
    except TemplateError as exc:  # e.g. a template that refuses system messages or roles that do not alternate
        raise ValueError(f"the model's chat template refused these messages: {exc}") from exc


def _as_api_error(exc: Exception, request: EngineRequest) -> APIError:
    """The engine's admission errors as the API errors a client should see."""
    from ddtree.engine import PromptTooLongError
    from ddtree.scheduler import EngineFullError
    from deployments.engine_loop import EngineDeadError

    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return engine_unavailable(str(exc))
    if isinstance(exc, PromptTooLongError):
        return prompt_too_long(str(exc), request.prompt_param)
    if isinstance(exc, EngineFullError):
        return queue_full(str(exc))
    if isinstance(exc, ValueError):
        return bad_request(str(exc), request.prompt_param, "invalid_value")
    return internal_error(f"engine failure: {type(exc).__name__}: {exc}")
