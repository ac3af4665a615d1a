"""The ingress deployment: the OpenAI HTTP API (FastAPI) and the Python handle API, in front of the engine replicas.

HTTP: POST /v1/completions, POST /v1/chat/completions (SSE with `stream: true`), GET /v1/models[/{model}],
GET /health; JSON, or msgpack bodies and non-streamed answers (`MSGPACK_MEDIA_TYPES`).
Python (`serve.get_app_handle(name)`): `generate(prompt | messages=..., params)` -> the final `RequestOutput`;
`generate_stream(...)` with `handle.options(stream=True)` -> incremental `RequestOutput`s.
"""

# No `from __future__ import annotations` here: FastAPI reads the route signatures (Request) at runtime.
import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator

import msgpack
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.exceptions import RequestCancelledError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from ddtree.sampling_params import SamplingParams
from deployments import protocol, responses
from deployments.config import AppArgs, IngressSettings, parse_args
from deployments.engine_request import EngineRequest
from deployments.errors import (
    APIError,
    bad_request,
    body_too_large,
    engine_not_ready,
    internal_error,
    model_not_found,
    not_found,
    unauthorized,
    unwrap,
)

logger = logging.getLogger(__name__)

# OpenAI's chat API has no default max_tokens (the rest of the context window); the engine caps it to the window.
UNLIMITED_MAX_TOKENS = 2**31 - 1
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# A body past this is refused (413) before it is parsed: 16 MiB holds the longest prompt an 8k-token window admits
# (663,552 characters for SmolLM2, docs/serving.md) many times over, JSON escapes included.
MAX_BODY_BYTES = 16 << 20
HEALTH_TIMEOUT_S = 5.0

# The OpenAPI document and its /docs page are routes of the ingress (`openapi_document`), which knows the name it
# serves; FastAPI's own would publish the request bodies as unknown (the routes read them themselves).
api = FastAPI(
    title="DDTree Serve",
    description="OpenAI-compatible API with DDTree speculative decoding",
    openapi_url=None,
    docs_url=None,
    redoc_url=None,
)


def openapi_document(app: FastAPI, served_model_name: str | None) -> dict:
    """FastAPI's document, with the request bodies the routes read themselves (as JSON; msgpack carries the same
    fields): their models' schemas, `model` the served name, so that a client generator or a fuzzer sees what each
    route accepts. Built on each request (a few ms, rarely asked): the name may change in place (`user_config`)."""
    from fastapi.openapi.utils import get_openapi

    routes = [r for r in app.routes if getattr(r, "include_in_schema", True)]
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=routes)
    for path, model in (
        ("/v1/completions", protocol.CompletionRequest),
        ("/v1/chat/completions", protocol.ChatCompletionRequest),
    ):
        schema["paths"][path]["post"]["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": protocol.request_body_schema(model, served_model_name)}},
        }
    return schema


# The binary option (the project's design notes, "Wire formats"): a request body in msgpack with this Content-Type, and
# a non-streamed answer (errors included) in msgpack when the Accept header names it; JSON otherwise.
MSGPACK_MEDIA_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")


def _media_type(value: str) -> str:
    return value.split(";")[0].strip().lower()


def _wants_msgpack(request: Request) -> bool:
    """The Accept header ranks a msgpack type above zero and no lower than JSON (`application/json`, or the
    `application/*` and `*/*` ranges that cover it), by their q-values (RFC 9110; a malformed q counts as 1)."""
    quality: dict[str, float] = {}
    for header in request.headers.getlist("accept"):
        for part in header.split(","):
            media_type, *params = (p.strip().lower() for p in part.split(";"))
            q = 1.0
            for param in params:
                name, _, value = param.partition("=")
                if name.strip() == "q":
                    try:
                        q = min(max(float(value), 0.0), 1.0)
                    except ValueError:
                        q = 1.0
            quality[media_type] = max(q, quality.get(media_type, 0.0))
    msgpack_q = max(quality.get(t, 0.0) for t in MSGPACK_MEDIA_TYPES)
    json_q = max(quality.get(t, 0.0) for t in ("application/json", "application/*", "*/*"))
    return msgpack_q > 0 and msgpack_q >= json_q


def _answer(request: Request, body: dict, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    if _wants_msgpack(request):
        return Response(msgpack.packb(body), status_code=status, media_type=MSGPACK_MEDIA_TYPES[0], headers=headers)
    return JSONResponse(body, status_code=status, headers=headers)


@api.exception_handler(APIError)
async def _api_error(request: Request, exc: APIError) -> Response:
    return _answer(request, exc.body(), exc.status, exc.headers())


@api.exception_handler(RequestValidationError)
async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    return JSONResponse(bad_request(str(exc.errors()[0].get("msg", exc))).body(), status_code=400)


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 404:
        error = not_found(request.url.path)
    else:
        error = APIError(exc.status_code, str(exc.detail), "invalid_request_error", None, None)
    return JSONResponse(error.body(), status_code=exc.status_code)


# Module functions come before the class: serve.ingress pickles the routes (with the globals they see)
# when it decorates.


def _python_request(prompt, params, messages) -> EngineRequest:
    try:
        return EngineRequest(prompt=prompt, messages=messages, params=params, request_id=responses.new_id("py"))
    except ValueError as exc:
        raise bad_request(str(exc)) from None


async def _engine_call(awaitable):
    """Await an engine call. The engine answers a refused request with an APIError object (raised here); a failure
    of the engine arrives as an exception wrapped by Ray, raised here as the API error inside it or as a 500."""
    try:
        result = await awaitable
    except StopAsyncIteration:
        raise
    except Exception as exc:  # noqa: BLE001 - every failure must reach the client in the API's shape
        cause = unwrap(exc)
        if isinstance(cause, APIError):
            raise APIError(
                cause.status, cause.message, cause.type, cause.param, cause.code, cause.retry_after
            ) from None
        if isinstance(exc, RequestCancelledError) or isinstance(cause, RequestCancelledError):
            raise  # the client went away (Serve cancels its request): nothing failed, no one to answer
        logger.exception("engine call failed")
        raise internal_error(f"engine call failed: {type(cause).__name__}: {cause}") from None
    if isinstance(result, APIError):
        raise result
    return result


def _cancel_all(calls) -> None:
    for response in calls:
        response.cancel()


async def _cancel_after_response(calls) -> None:
    """`_cancel_all` as a response's background task. It must be a coroutine function: Starlette runs a plain
    function in a worker thread, where an in-process engine stream (`server._LocalStream`, `ingress: engine`) cannot
    schedule its close on the event loop."""
    _cancel_all(calls)


async def _read_body(request: Request) -> bytes:
    """The body's bytes, refused (413) past MAX_BODY_BYTES: at once when Content-Length says so, else as soon as
    the bytes received pass it (a chunked body), so that no replica buffers more than the limit."""
    too_large = body_too_large(f"The request body is larger than {MAX_BODY_BYTES} bytes.")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise too_large
    return bytes(body)


async def _body(request: Request):
    """The request body: msgpack when its Content-Type says so, else JSON."""
    raw = await _read_body(request)
    if _media_type(request.headers.get("content-type", "")) in MSGPACK_MEDIA_TYPES:
        try:
            return msgpack.unpackb(raw, raw=False)
        except (ValueError, msgpack.UnpackException):  # (ExtraData, FormatError, StackError, bad UTF-8: ValueErrors)
            raise bad_request("The request body is not valid msgpack.") from None
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise bad_request("The request body is not valid JSON.") from None
    except RecursionError:
        raise bad_request("The request body nests too deeply.") from None


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


@serve.ingress(api)
class OpenAIIngress:
    def __init__(self, engine, args: AppArgs | dict) -> None:
        self.engine = engine  # DeploymentHandle of DDTreeEngine
        self.args = parse_args(args)
        self.created = int(time.time())
        self._has_answered = False  # an engine replica has answered `ready` (then /v1/models no longer asks)
        self._apply(IngressSettings.of(self.args))

    def reconfigure(self, user_config: dict) -> None:
        """Serve's in-place update of the deployment's `user_config` (IngressSettings): served name, API key,
        default_max_tokens, over the args' values. An invalid one is logged and changes nothing: raising here would
        make Serve stop this replica and fail its replacements, taking the whole API down for a typo."""
        try:
            settings = IngressSettings.of(self.args, user_config)
        except ValueError as exc:
            logger.error("OpenAIIngress user_config refused, settings unchanged: %s", exc)
            return
        self._apply(settings)

    def _apply(self, settings: IngressSettings) -> None:
        self.model_name = settings.served_model_name or self.args.model_name
        self._api_key = settings.api_key.get_secret_value().encode() if settings.api_key is not None else None
        self.default_max_tokens = settings.default_max_tokens

    # ------------------------------------------------------------------------------------------------------------
    # HTTP

    @api.get("/openapi.json", include_in_schema=False)
    async def openapi(self) -> JSONResponse:
        return JSONResponse(openapi_document(api, self.model_name))

    @api.get("/docs", include_in_schema=False)
    async def docs(self):
        from fastapi.openapi.docs import get_swagger_ui_html

        return get_swagger_ui_html(openapi_url="openapi.json", title="DDTree Serve")

    @api.get("/health")
    async def health(self) -> dict:
        """200 once an engine replica answers (Serve routes to the ingress while the engines still load)."""
        await self._engine_ready()
        return {"status": "ok"}

    async def _engine_ready(self) -> None:
        """Returns once an engine replica answers; a 503 (engine_not_ready) while none does."""
        response = self.engine.ready.remote()
        try:
            await asyncio.wait_for(_engine_call(response), HEALTH_TIMEOUT_S)
        except (asyncio.TimeoutError, APIError):
            response.cancel()
            raise engine_not_ready("The engine is not ready.") from None
        self._has_answered = True

    @api.get("/v1/models")
    async def models(self, request: Request) -> Response:
        self._authorize(request)
        if not self._has_answered:  # (a separate ingress is up before its engines have loaded)
            await self._engine_ready()
        return _answer(request, responses.models_body(self.model_name, self.created))

    @api.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, request: Request) -> Response:
        self._authorize(request)
        self._check_model(model_id)
        return _answer(request, responses.models_body(self.model_name, self.created)["data"][0])

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        self._authorize(request)
        body = protocol.parse_request(protocol.CompletionRequest, await _body(request))
        self._check_model(body.model)
        params = body.sampling_params(COMPLETIONS_DEFAULT_MAX_TOKENS)
        response_id = responses.new_id("cmpl")
        # A batch of prompts: one engine request each (choice i answers prompt i)
        engine_requests = [
            EngineRequest(
                prompt=prompt,
                params=params,
                request_id=response_id if len(body.prompt) == 1 else f"{response_id}-{i}",
                strict_max_tokens=body.gives_max_tokens,
            )
            for i, prompt in enumerate(body.prompt)
        ]
        return await self._respond(request, body, response_id, engine_requests, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        self._authorize(request)
        body = protocol.parse_request(protocol.ChatCompletionRequest, await _body(request))
        self._check_model(body.model)
        response_id = responses.new_id("chatcmpl")
        engine_request = EngineRequest(
            messages=body.template_messages(),
            params=body.sampling_params(self.default_max_tokens or UNLIMITED_MAX_TOKENS),
            request_id=response_id,
            strict_max_tokens=body.gives_max_tokens,
        )
        return await self._respond(request, body, response_id, [engine_request], chat=True)

    def _authorize(self, request: Request) -> None:
        if self._api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._api_key):
            raise unauthorized(
                "Incorrect API key provided." if header else "Missing API key: send 'Authorization: Bearer <key>'."
            )

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise model_not_found(model, self.model_name)

    async def _respond(
        self, request: Request, body, response_id: str, engine_requests: list[EngineRequest], chat: bool
    ):
        """The answer to one API request: its engine requests (one per prompt) run concurrently; if one is refused,
        the others are cancelled and the refusal is the answer."""
        if not body.stream:
            calls = [self.engine.generate.remote(r) for r in engine_requests]
            try:
                finals = await asyncio.gather(*(_engine_call(r) for r in calls))
            except BaseException:
                _cancel_all(calls)
                raise
            usage = responses.usage_of(finals, self.args.speculation)
            if chat:
                (final,) = finals
                return _answer(
                    request,
                    responses.chat_body(
                        response_id, self.model_name, final.text, final.finish_reason, usage, final.logprobs
                    ),
                )
            return _answer(
                request,
                responses.completion_body(
                    response_id, self.model_name, [(f.text, f.finish_reason, f.logprobs) for f in finals], usage
                ),
            )
        streams = [self.engine.options(stream=True).generate_stream.remote(r) for r in engine_requests]
        # The first outputs (or an admission error: bad prompt, too long, queue full) before any byte is sent, so
        # that errors keep their HTTP status.
        try:
            firsts = await asyncio.gather(*(_engine_call(s.__anext__()) for s in streams))
        except BaseException:
            _cancel_all(streams)
            raise
        events = self._sse(firsts, streams, body, response_id, chat)
        # `_sse` cancels in its `finally`; a client gone before the body starts never starts `_sse`, and closing an
        # unstarted generator runs no `finally`: Starlette's background task runs after the response either way.
        return StreamingResponse(
            events, media_type="text/event-stream", background=BackgroundTask(_cancel_after_response, streams)
        )

    async def _sse(self, firsts: list, streams: list, body, response_id: str, chat: bool) -> AsyncIterator[str]:
        """Server-sent events of one or more engine streams (a batch of prompts: each chunk names its choice's
        index), merged in the order their outputs arrive."""
        created = int(time.time())
        include_usage = body.include_usage
        model = self.model_name
        logprobs = [responses.StreamLogprobs(chat) if f.new_logprobs is not None else None for f in firsts]

        def chunk(index: int, text: str, finish_reason: str | None) -> dict:
            lp = logprobs[index].take() if logprobs[index] is not None else None
            if chat:
                return responses.chat_chunk(
                    response_id,
                    model,
                    created,
                    {"content": text} if text or not finish_reason else {},
                    finish_reason,
                    include_usage,
                    lp,
                )
            return responses.completion_chunk(
                response_id, model, created, text, finish_reason, include_usage, lp, index
            )

        arrived: asyncio.Queue = asyncio.Queue()

        async def forward(index: int, output, stream) -> None:
            """Queue a stream's outputs (the first is already here), or the error that ends it."""
            try:
                while True:
                    await arrived.put((index, output, None))
                    if output.finished:
                        return
                    output = await _engine_call(stream.__anext__())
            except StopAsyncIteration:  # (raised inside `_sse`, an async generator, it would become a RuntimeError)
                await arrived.put((index, None, internal_error("the engine's stream ended before its last output")))
            except Exception as exc:  # noqa: BLE001 - raised where the events are written
                await arrived.put((index, None, exc))

        tasks = [
            asyncio.create_task(forward(i, first, stream)) for i, (first, stream) in enumerate(zip(firsts, streams))
        ]
        finals = [None] * len(streams)
        try:
            if chat:
                role = responses.chat_chunk(
                    response_id, model, created, {"role": "assistant", "content": ""}, None, include_usage
                )
                yield _event(role)
            num_open = len(streams)
            while num_open:
                index, output, exc = await arrived.get()
                if exc is not None:
                    raise exc
                if logprobs[index] is not None:
                    logprobs[index].add(output.new_logprobs)
                if output.new_text or output.finished:
                    yield _event(chunk(index, output.new_text, output.finish_reason if output.finished else None))
                if output.finished:
                    finals[index] = output
                    num_open -= 1
            if include_usage:
                usage = responses.usage_of(finals, self.args.speculation)
                yield _event(
                    responses.usage_chunk(
                        response_id, model, created, "chat.completion.chunk" if chat else "text_completion", usage
                    )
                )
            yield "data: [DONE]\n\n"
        except APIError as exc:  # after the headers went out: the error travels as an event, then the stream's end
            yield _event(exc.body())
            yield "data: [DONE]\n\n"
        finally:
            for task in tasks:
                task.cancel()
            _cancel_all(streams)  # a client that went away aborts its requests on the engine

    # ------------------------------------------------------------------------------------------------------------
    # Python handle API

    async def info(self) -> dict:
        """The engine replica's settings and cumulative timings (`DDTreeEngine.info`), from one replica."""
        return await _engine_call(self.engine.info.remote())

    async def generate(
        self,
        prompt: str | list[int] | None = None,
        params: SamplingParams | None = None,
        *,
        messages: list[dict] | None = None,
    ):
        """The finished `ddtree.RequestOutput` for a prompt (text or token ids) or chat `messages`."""
        request = _python_request(prompt, params, messages)
        return await _engine_call(self.engine.generate.remote(request))

    async def generate_stream(
        self,
        prompt: str | list[int] | None = None,
        params: SamplingParams | None = None,
        *,
        messages: list[dict] | None = None,
    ) -> AsyncIterator:
        """Incremental `RequestOutput`s (`new_text`, `new_token_ids`); call with `handle.options(stream=True)`."""
        request = _python_request(prompt, params, messages)
        outputs = self.engine.options(stream=True).generate_stream.remote(request)
        try:
            while True:
                try:
                    output = await _engine_call(outputs.__anext__())
                except StopAsyncIteration:
                    return
                yield output
                if output.finished:
                    return
        finally:
            outputs.cancel()
