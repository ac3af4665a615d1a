"""The naive baseline of the load tests: Hugging Face `generate()` per request behind the OpenAI routes, on Ray Serve.

    serve run loadtest.hf_baseline:build_app model=/path/to/hf/folder num_cpus=2

This is the server a user writes in an afternoon, and what DDTree Serve is measured against (loadtest/sweep.py,
docs/serving.md): one replica holding the model, each request its own `model.generate()` in a thread of its own,
streamed with `TextIteratorStreamer`. No batching across requests, no KV cache management, no speculation. It serves
`/v1/models`, `/v1/completions` and `/v1/chat/completions` (streaming and `stream_options.include_usage` included)
with greedy decoding at temperature 0 and sampling otherwise; a request that asks for more than that (n > 1, stop
strings, logprobs, tools) is a 400. A client that goes away stops its generation at the next token.

`model` defaults to the embedded SmolLM2-135M-Instruct (its converted folder, ddtree/models/default.py).
"""

# No `from __future__ import annotations` here: FastAPI reads the route signatures (Request) at runtime.
import asyncio
import json
import threading
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

api = FastAPI()

_ALLOWED = {
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "stream",
    "stream_options",
    "seed",
    "n",
    "user",
}


class BadRequest(Exception):
    pass


def _error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}},
        status_code=status,
    )


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise BadRequest(f"'{name}' must be a number in [{low}, {high}]")
    return float(value)


# Module functions come before the class: serve.ingress pickles the routes (with the globals they see)
# when it decorates.


class _Generation:
    """One request's `generate()` in a thread of its own, its text read piece by piece from a streamer."""

    def __init__(
        self,
        server: "HFGenerate",
        prompt_ids: list[int],
        max_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | None,
    ) -> None:
        from transformers import StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer

        torch = server.torch
        self.id = uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.model_name = server.name
        self.prompt_tokens = len(prompt_ids)
        self.completion_tokens = 0
        self.finish_reason = "length"
        self.cancelled = threading.Event()
        self.streamer = TextIteratorStreamer(server.tokenizer, skip_prompt=True, skip_special_tokens=True, timeout=600)
        cancelled = self.cancelled

        class _Cancelled(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                return cancelled.is_set()

        sampling = (
            {"do_sample": False}
            if temperature == 0
            else {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}
        )
        kwargs = dict(
            input_ids=torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_tokens,
            streamer=self.streamer,
            stopping_criteria=StoppingCriteriaList([_Cancelled()]),
            pad_token_id=server.tokenizer.eos_token_id,
            **sampling,
        )
        eos = server.model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()

        def run() -> None:
            try:
                with torch.inference_mode():
                    if seed is not None:
                        torch.manual_seed(seed)  # (global: concurrent seeded requests are not reproducible)
                    out = server.model.generate(**kwargs)[0, len(prompt_ids) :].tolist()
                self.completion_tokens = len(out)
                if out and out[-1] in self.eos:
                    self.finish_reason = "stop"
            except BaseException:
                self.finish_reason = "error"
                self.streamer.end()
                raise

        self.thread = threading.Thread(target=run, daemon=True, name=f"generate-{self.id}")
        self.thread.start()

    def pieces(self):
        try:
            yield from self.streamer
            self.thread.join()
        finally:
            self.cancelled.set()  # a client gone mid-stream stops its generation at the next token

    def usage(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    def events(self, chat: bool, include_usage: bool):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def event(**fields) -> str:
            fields = {"id": self.id, "object": obj, "created": self.created, "model": self.model_name, **fields}
            return f"data: {json.dumps(fields)}\n\n"

        def chunk(text: str | None, finish: str | None) -> str:
            if chat:
                choice = {"index": 0, "delta": {} if text is None else {"content": text}, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish}
            return event(choices=[choice])

        if chat:
            yield event(choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
        for piece in self.pieces():
            if piece:
                yield chunk(piece, None)
        if self.finish_reason == "error":
            yield f"data: {json.dumps({'error': {'message': 'generation failed', 'type': 'server_error'}})}\n\n"
        else:
            yield chunk(None, self.finish_reason)
            if include_usage:
                yield event(choices=[], usage=self.usage())
        yield "data: [DONE]\n\n"


def _body(run: _Generation, chat: bool, text: str) -> JSONResponse:
    if run.finish_reason == "error":
        return _error("generation failed", 500)
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": run.finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": run.finish_reason}
        obj = "text_completion"
    return JSONResponse(
        {
            "id": run.id,
            "object": obj,
            "created": run.created,
            "model": run.model_name,
            "choices": [choice],
            "usage": run.usage(),
        }
    )


@serve.deployment(max_ongoing_requests=64)
@serve.ingress(api)
class HFGenerate:
    def __init__(self, model: str | None = None, served_model_name: str | None = None, default_max_tokens: int = 256):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if model is None:
            from ddtree.models.default import default_target_dir

            model = str(default_target_dir())
        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self.name = served_model_name or "SmolLM2-135M-Instruct"
        self.default_max_tokens = default_max_tokens
        self.context_len = int(getattr(self.model.config, "max_position_embeddings", 2048))

    @api.get("/v1/models")
    def models(self):
        return {
            "object": "list",
            "data": [{"id": self.name, "object": "model", "created": 0, "owned_by": "hf-generate"}],
        }

    @api.post("/v1/chat/completions")
    async def chat(self, request: Request):
        return await self._serve(request, chat=True)

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._serve(request, chat=False)

    async def _serve(self, request: Request, chat: bool):
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise BadRequest("the body must be a JSON object")
            prompt_ids, settings = self._parse(body, chat)
        except (BadRequest, ValueError) as exc:
            return _error(str(exc))
        run = _Generation(self, prompt_ids, **settings)
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(run.events(chat, include_usage), media_type="text/event-stream")
        text = await asyncio.to_thread(lambda: "".join(run.pieces()))
        return _body(run, chat, text)

    def _parse(self, body: dict, chat: bool) -> tuple[list[int], dict]:
        unknown = set(body) - _ALLOWED
        if unknown:
            raise BadRequest(f"unsupported fields: {sorted(unknown)}")
        if body.get("model") != self.name:
            raise BadRequest(f"the model '{body.get('model')}' does not exist; this server serves '{self.name}'")
        if body.get("n", 1) != 1:
            raise BadRequest("only n=1 is supported")
        if chat:
            messages = body.get("messages")
            if (
                not isinstance(messages, list)
                or not messages
                or not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages)
            ):
                raise BadRequest("'messages' must be a non-empty list of {role, content} objects")
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if not isinstance(ids, list):  # (a BatchEncoding in newer transformers)
                ids = list(ids["input_ids"])
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str) or not prompt:
                raise BadRequest("'prompt' must be a non-empty string")
            ids = self.tokenizer(prompt)["input_ids"]
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens")) or self.default_max_tokens
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise BadRequest("'max_tokens' must be a positive integer")
        if len(ids) + max_tokens > self.context_len:
            raise BadRequest(
                f"the prompt ({len(ids)} tokens) and max_tokens ({max_tokens}) exceed the context "
                f"window of {self.context_len} tokens"
            )
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise BadRequest("'seed' must be an integer")
        return ids, {
            "max_tokens": max_tokens,
            "temperature": _number(body, "temperature", 1.0, 0.0, 2.0),
            "top_p": _number(body, "top_p", 1.0, 1e-6, 1.0),
            "seed": seed,
        }


def build_app(args: dict | None = None):
    """`serve run loadtest.hf_baseline:build_app [model=...] [served_model_name=...] [num_cpus=2]`."""
    args = dict(args or {})
    unknown = set(args) - {"model", "served_model_name", "num_cpus", "default_max_tokens"}
    if unknown:
        raise ValueError(f"unknown args for the HF baseline: {sorted(unknown)}")
    num_cpus = float(args.pop("num_cpus", 2))
    if "default_max_tokens" in args:
        args["default_max_tokens"] = int(args["default_max_tokens"])
    return HFGenerate.options(ray_actor_options={"num_cpus": num_cpus}).bind(**args)
