"""The offline API: `LLM(...).generate(prompts, params)`, `.chat(conversations, params)`, `.stream(prompt, params)`."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Sequence

from ddtree.config import EngineConfig
from ddtree.engine import Engine
from ddtree.outputs import RequestOutput
from ddtree.sampling_params import SamplingParams
from ddtree.scheduler import EngineFullError

logger = logging.getLogger("ddtree")


def show_progress() -> None:
    """Loading messages go to stderr where the application has configured no logging (as vLLM's do), unless
    DDTREE_CONFIGURE_LOGGING=0. An application that configures logging gets them through its own handlers."""
    if os.environ.get("DDTREE_CONFIGURE_LOGGING", "1") == "0" or logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("ddtree: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


class LLM:
    """Runs the whole engine in this process.

    `LLM()` loads the embedded default pair (SmolLM2-135M-Instruct and the shipped DFlash drafter) on CPU.
    `model`: a local Hugging Face folder (config.json + safetensors), a .gguf file, or a hub id where a network
    allows; None: the embedded default. `drafter`: a local DFlash checkpoint folder trained for that target; None
    only with the embedded target (its shipped drafter). `speculation`: "ddtree" (draft trees),
    "dflash" (the drafter's argmax chain, the single-path baseline) or "off" (plain autoregressive decoding).
    `budget`: "auto" (adaptive per request and per round) or a fixed node count per speculative request.
    `allow_fallback` (auto budget): requests whose drafts do not pay decode autoregressively, probed again at most
    `max_probe_overhead` of their time (docs/engine.md, "Budgets and fallback"); a round speculates only where the
    policy predicts it faster than plain decoding by more than `speculation_margin`. `ngram_tokens` (auto budget): up
    to this many tokens proposed from the request's own history (prompt lookup) join its tree, or are verified
    alone by a request in fallback; 0 turns them off. `max_explore_share` (auto budget): the engine runs, per batch
    size, the faster of "as the policy plans" and plain decoding, as measured, and the other in at most this share
    of the time (docs/engine.md, "The closed loop"); 0: the policy alone. `max_folded_prompt_tokens`: newly admitted
    prompts up to this many tokens in all join the round's verify pass instead of a prefill pass of their own
    (docs/engine.md, "Admission"); 0: always a pass of their own. Every engine setting and its default:
    `ddtree.config.EngineConfig`.
    """

    def __init__(
        self,
        model: str | None = None,
        drafter: str | None = None,
        *,
        device: str = "cpu",
        dtype: str | None = None,
        speculation: str = "ddtree",
        budget: int | str = "auto",
        max_budget: int = 64,
        max_num_seqs: int = 16,
        max_waiting: int = 256,
        max_model_len: int | None = None,
        kv_cache_bytes: int | None = None,
        attention: str = "auto",
        allow_fallback: bool = True,
        max_probe_overhead: float = 0.03,
        speculation_margin: float = 0.05,
        ngram_tokens: int = 3,
        pipeline: bool | str = "auto",
        max_explore_share: float = 0.03,
        max_queue_seconds: float | None = None,
        max_folded_prompt_tokens: int = 512,
    ) -> None:
        from ddtree.loaders import build_workers

        config = EngineConfig(
            speculation=speculation,
            budget=budget,
            max_budget=max_budget,
            max_num_seqs=max_num_seqs,
            max_waiting=max_waiting,
            max_model_len=max_model_len,
            allow_fallback=allow_fallback,
            max_probe_overhead=max_probe_overhead,
            speculation_margin=speculation_margin,
            ngram_tokens=ngram_tokens,
            pipeline=pipeline,
            max_explore_share=max_explore_share,
            max_queue_seconds=max_queue_seconds,
            max_folded_prompt_tokens=max_folded_prompt_tokens,
        )
        show_progress()
        t0 = time.perf_counter()
        what = model if model is not None else "the embedded SmolLM2-135M-Instruct"
        with_drafter = " and its drafter" if speculation != "off" else ""
        logger.info("loading %s%s on %s", what, with_drafter, device)
        target, drafter_worker, tokenizer = build_workers(
            model,
            drafter,
            device=device,
            dtype=dtype,
            need_drafter=speculation != "off",
            kv_cache_bytes=kv_cache_bytes,
            attention=attention,
        )
        self.engine = Engine(config, target, drafter_worker, tokenizer)
        logger.info("ready in %.1f s (speculation %s)", time.perf_counter() - t0, speculation)
        self.tokenizer = tokenizer
        self._outbox: dict[str, list[RequestOutput]] = {}

    @classmethod
    def from_engine(cls, engine: Engine) -> LLM:
        llm = cls.__new__(cls)
        llm.engine, llm.tokenizer = engine, engine.tokenizer
        llm._outbox = {}
        return llm

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One final output per prompt, in order. Prompts are strings or lists of token ids."""
        if not isinstance(prompts, (str, list, tuple)):
            raise ValueError(
                f"prompts must be a string, a list of token ids, or a list of those; got {type(prompts).__name__}"
            )
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = _per_prompt(params, len(prompts))
        return self._run(list(zip(prompts, params_list)))

    def chat(
        self,
        conversations: Sequence[dict] | Sequence[Sequence[dict]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Conversations are lists of {"role", "content"} messages; the model's chat template is applied."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, params)

    def apply_chat_template(self, messages: Sequence[dict]) -> list[int]:
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError("each chat message must be a dict with string 'role' and 'content'")
        ids = self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return [int(t) for t in ids]

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Incremental outputs for one prompt: each has the `new_text`/`new_token_ids` of one engine step. Several
        streams (and `generate` calls between their steps) share the engine: whichever steps it files every
        request's outputs for its own caller."""
        request_id = self.engine.add_request(prompt if isinstance(prompt, str) else list(prompt), params)
        mine = self._outbox[request_id] = []
        try:
            while True:
                if not mine:
                    self._check_alive(request_id)
                    self._step()
                while mine:
                    out = mine.pop(0)
                    yield out
                    if out.finished:
                        return
        finally:
            self._outbox.pop(request_id, None)
            if request_id in self.engine.requests:
                self.engine.abort_request(request_id)

    def _check_alive(self, request_id: str) -> None:
        """A request that left the engine without a final output here (aborted through `llm.engine`, or stepped
        by another wrapper of the same engine) would be waited for forever."""
        if request_id not in self.engine.requests:
            raise RuntimeError(
                f"request {request_id} left the engine without its final output reaching this call "
                f"(aborted through llm.engine, or stepped by another LLM on the same engine)"
            )

    def _step(self, closed_batch: bool = False) -> None:
        """One engine step; each output goes to the outbox of the call that added its request."""
        for out in self.engine.step(closed_batch):
            box = self._outbox.get(out.request_id)
            if box is not None:
                box.append(out)

    def _run(self, items: list[tuple]) -> list[RequestOutput]:
        # Validate everything before queueing anything: a bad prompt fails the call and leaves no work behind.
        items = [self.engine.validate(prompt if isinstance(prompt, str) else list(prompt), p) for prompt, p in items]
        finals: dict[str, RequestOutput] = {}
        order: list[str] = []
        unfinished: list[str] = []
        pending = list(items)
        try:
            while pending or unfinished:
                while pending:
                    prompt, params = pending[0]
                    try:
                        rid = self.engine.add_request(prompt, params)
                    except EngineFullError:
                        break
                    order.append(rid)
                    unfinished.append(rid)
                    self._outbox[rid] = []
                    pending.pop(0)
                for rid in unfinished:
                    self._check_alive(rid)
                # Closed: every prompt of the call is in the engine, and no other call (a stream) will add one. The
                # outbox holds a box per request of this call (`order`) until it returns, and others' besides.
                self._step(closed_batch=not pending and len(self._outbox) == len(order))
                still = []
                for rid in unfinished:
                    box = self._outbox[rid]
                    if box and box[-1].finished:
                        finals[rid] = box[-1]
                    else:
                        still.append(rid)
                    box.clear()
                unfinished = still
        finally:  # interrupted (Ctrl-C, an error): nothing of this call stays queued or holds the KV cache
            for rid in order:
                self._outbox.pop(rid, None)
                if rid not in finals and rid in self.engine.requests:
                    self.engine.abort_request(rid)
        return [finals[rid] for rid in order]


def _per_prompt(params, n: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return params
