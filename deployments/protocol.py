"""The OpenAI wire protocol, requests: models validated with pydantic, their SamplingParams, the published schema.

The response bodies are deployments/responses.py.

Only what the engine does is accepted. Fields the engine cannot honour (n > 1, penalties, logit_bias, tools, ...) are a
400 when set to anything but their neutral value, never silently ignored; unknown fields are a 400 too. Metadata
fields that change nothing about the answer (user, store, metadata, ...) are accepted and ignored.

Extensions (not in OpenAI's API, as in vLLM): `top_k`, `ignore_eos`, `stop_token_ids` in requests, and
`usage.ddtree` (acceptance statistics of the request) in responses; vLLM's `repetition_penalty`, `min_tokens`,
`skip_special_tokens` and `include_stop_str_in_output` are accepted at their neutral values (1, 0, true, false).
Speculation settings are per deployment, not per request: the engine batches every request in one verify pass under
one policy.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from ddtree.sampling_params import MAX_LOGPROBS, SamplingParams
from deployments.errors import APIError, bad_request

MAX_STOP_SEQUENCES = 16
# Fields accepted at these values only (the neutral ones; anything else is a 400, never silently ignored). The
# validators check them, and the published schema (`request_body_schema`) gives them as enums.
NEUTRAL_VALUES: dict[str, tuple] = {
    "n": (1,),
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "repetition_penalty": (1,),
    "min_tokens": (0,),
    "skip_special_tokens": (True,),
    "include_stop_str_in_output": (False,),
    "echo": (False,),
    "suffix": (None,),
    "best_of": (None, 1),
}
# What a client may send that does not change the answer; accepted and ignored.
_IGNORED_METADATA = ("user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key")


# Integers and booleans are strict, as OpenAI's API is: `"max_tokens": true` or `"stream": "yes"` is a 400, not 1 and
# True. Floats take integers (`"temperature": 1`) but not strings.


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class _GenerationRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0, strict=True, allow_inf_nan=False)  # OpenAI's default and range
    top_p: float = Field(1.0, gt=0.0, le=1.0, strict=True, allow_inf_nan=False)
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # Accepted only at their neutral values:
    n: StrictInt = 1
    frequency_penalty: float = Field(0.0, strict=True)
    presence_penalty: float = Field(0.0, strict=True)
    logit_bias: dict[str, Annotated[float, Field(strict=True)]] | None = None
    # vLLM's extensions, accepted at the values that change nothing (clients written for vLLM send them):
    repetition_penalty: float = Field(1.0, strict=True)
    min_tokens: StrictInt = 0
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    # Extensions:
    top_k: StrictInt = Field(
        0, ge=-1, description="Sample among the k most likely tokens only (0 or -1, vLLM's spelling: off)."
    )
    ignore_eos: StrictBool = Field(False, description="Keep generating past the end-of-sequence token.")
    stop_token_ids: list[StrictInt] | None = Field(None, description="Token ids that end the generation.")
    # Ignored metadata:
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: StrictBool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        """OpenAI's API takes null for its optional fields (clients send `temperature: null`): the default applies.
        Fields without a default (`model`, `prompt`, `messages`) stay required."""
        if not isinstance(data, dict):
            return data
        defaulted = {name for name, f in cls.model_fields.items() if not f.is_required() and f.default is not None}
        return {k: v for k, v in data.items() if v is not None or k not in defaulted}

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop):
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return stops

    @model_validator(mode="after")
    def _check_unsupported(self):
        neutral = {name: getattr(self, name) in NEUTRAL_VALUES[name] for name in NEUTRAL_VALUES if hasattr(self, name)}
        _require_neutral(neutral["n"], "n", "only n=1 is supported")
        _require_neutral(neutral["frequency_penalty"], "frequency_penalty", "frequency_penalty is not supported")
        _require_neutral(neutral["presence_penalty"], "presence_penalty", "presence_penalty is not supported")
        _require_neutral(not any((self.logit_bias or {}).values()), "logit_bias", "logit_bias is not supported")
        _require_neutral(neutral["repetition_penalty"], "repetition_penalty", "repetition_penalty is not supported")
        _require_neutral(neutral["min_tokens"], "min_tokens", "min_tokens is not supported")
        _require_neutral(
            neutral["skip_special_tokens"], "skip_special_tokens", "special tokens are always skipped in the text"
        )
        _require_neutral(
            neutral["include_stop_str_in_output"],
            "include_stop_str_in_output",
            "the stop string is never included in the output",
        )
        _require_neutral(
            self.stream or self.stream_options is None,
            "stream_options",
            "stream_options is only allowed with stream=true",
        )
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def gives_max_tokens(self) -> bool:
        """Whether the client chose max_tokens (a prompt leaving less room in the window is then refused)."""
        return self._max_tokens() is not None

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """The engine's SamplingParams; what they reject (e.g. negative stop_token_ids) is a 400."""
        max_tokens = self._max_tokens()
        try:
            return self._sampling_params(max_tokens if max_tokens is not None else default_max_tokens)
        except ValueError as exc:
            raise bad_request(str(exc), None, "invalid_value") from None

    def _sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            temperature=float(self.temperature),
            top_p=float(self.top_p),
            top_k=max(self.top_k, 0),
            max_tokens=max_tokens,
            stop=list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            logprobs=self._num_top_logprobs(),
        )

    def _num_top_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None when the request asks for no log-probabilities."""
        raise NotImplementedError

    def _max_tokens(self) -> int | None:
        return self.max_tokens


MAX_PROMPTS_PER_REQUEST = 128  # a batch of prompts in one completions request (each one an engine request)


class CompletionRequest(_GenerationRequest):
    # A string, token ids, or a batch of either: always a list of prompts once parsed (`true` is not token 1)
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)  # the k most likely per token (OpenAI: up to 5)
    echo: StrictBool = False
    suffix: str | None = None
    best_of: StrictInt | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_batch(cls, prompt) -> list[str | list[int]]:
        batch = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
        if len(batch) > MAX_PROMPTS_PER_REQUEST:
            raise ValueError(f"at most {MAX_PROMPTS_PER_REQUEST} prompts per request, got {len(batch)}")
        for one in batch:
            if len(one) == 0:
                raise ValueError("the prompt is empty")
            if isinstance(one, list) and any(t < 0 for t in one):
                raise ValueError("token ids must be >= 0")
        return batch

    @field_validator("logprobs", mode="before")
    @classmethod
    def _false_means_none(cls, value):
        return None if value is False else value  # clients send `logprobs: false` for "none"; `true` is refused

    @model_validator(mode="after")
    def _check_completion_unsupported(self):
        _require_neutral(self.echo in NEUTRAL_VALUES["echo"], "echo", "echo is not supported")
        _require_neutral(self.suffix in NEUTRAL_VALUES["suffix"], "suffix", "suffix is not supported")
        _require_neutral(self.best_of in NEUTRAL_VALUES["best_of"], "best_of", "only best_of=1 is supported")
        return self

    def _num_top_logprobs(self) -> int | None:
        return self.logprobs


class TextContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


# Fields of an assistant message that clients echo back from a previous response (the official client's message
# objects carry them): accepted when they say nothing (null or empty), refused otherwise (no tools, audio, refusals).
ECHOED_MESSAGE_FIELDS = ("refusal", "tool_calls", "function_call", "annotations", "audio")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextContentPart]
    name: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _drop_empty_echoed_fields(cls, data):
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if not (k in ECHOED_MESSAGE_FIELDS and v in (None, [], {}))}

    def as_template_message(self) -> dict[str, str]:
        # (text parts joined by newlines, as vLLM joins them)
        content = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        # Chat templates know "system"; OpenAI's newer "developer" role means the same thing.
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    parallel_tool_calls: StrictBool | None = None

    @model_validator(mode="after")
    def _check_chat_unsupported(self):
        _require_neutral(not self.tools, "tools", "tools are not supported")
        _require_neutral(self.tool_choice in (None, "none"), "tool_choice", "tool_choice is not supported")
        _require_neutral(
            self.response_format in (None, {"type": "text"}),
            "response_format",
            "only response_format {'type': 'text'} is supported",
        )
        if self.top_logprobs and not self.logprobs:
            raise _ParamError("top_logprobs", "top_logprobs needs logprobs=true")
        if (
            self.max_tokens is not None
            and self.max_completion_tokens is not None
            and self.max_tokens != self.max_completion_tokens
        ):
            raise _ParamError("max_completion_tokens", "max_tokens and max_completion_tokens disagree; give one")
        return self

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _num_top_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, str]]:
        return [m.as_template_message() for m in self.messages]


class _ParamError(ValueError):
    """A check across fields, naming the parameter the client should change."""

    code = "invalid_value"

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class _Unsupported(_ParamError):
    code = "unsupported_parameter"


def _require_neutral(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise _Unsupported(param, message)


def parse_request(model: type[BaseModel], body: Any) -> Any:
    """The validated request, or an APIError 400 naming the first bad parameter."""
    if not isinstance(body, dict):
        raise bad_request("The request body must be an object (a JSON object, or a msgpack map).")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _is_param_part(part) -> bool:
    if isinstance(part, int):
        return True
    return part != "body" and part.isidentifier() and part not in _TYPE_TAGS


def _param_path(error: dict) -> list:
    # pydantic's location, less its union-member tags ("str", "list[int]", "function-after[...]"): the parameter
    return [p for p in error.get("loc", ()) if _is_param_part(p)]


def validation_error(exc: ValidationError) -> APIError:
    errors = exc.errors()
    # A value no member of a union takes fails once per member: the member that got furthest into the value says
    # what is wrong (a content part of another type, not "should be a valid string").
    first_path = _param_path(errors[0])
    first = max(
        (e for e in errors if _param_path(e)[: len(first_path)] == first_path), key=lambda e: len(_param_path(e))
    )
    param = ".".join(str(p) for p in _param_path(first)) or None
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, _ParamError):
        return bad_request(str(cause), cause.param, cause.code)
    message = first.get("msg", "invalid request")
    if first.get("type") == "extra_forbidden":
        return bad_request(f"Unrecognized request argument: {param}", param, "unrecognized_parameter")
    if first.get("type") == "missing":
        return bad_request(f"Missing required parameter: {param}", param, "missing_parameter")
    return bad_request(f"Invalid value for {param}: {message.removeprefix('Value error, ')}", param, "invalid_value")


def request_body_schema(model: type[BaseModel], served_model_name: str | None = None) -> dict:
    """The JSON schema of a request model for the app's OpenAPI document, self-contained (pydantic's `$defs`
    inlined: the document's components do not hold them), with `model` naming the one served model when known."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node):
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(defs[node["$ref"].rsplit("/", 1)[-1]])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    schema = inline(schema)
    properties = schema["properties"]
    if served_model_name is not None:
        properties["model"] = {"type": "string", "enum": [served_model_name]}
    for name, values in NEUTRAL_VALUES.items():
        if name in properties:
            properties[name] = {"enum": list(values), "default": properties[name].get("default")}
    for name in ("prompt", "stop"):  # (no empty text, batch or stop string; token ids >= 0)
        if name in properties:
            properties[name] = _non_empty(properties[name])
    return schema


def _non_empty(node):
    if isinstance(node, dict):
        node = {k: _non_empty(v) for k, v in node.items()}
        kind = node.get("type")
        if kind == "string":
            node.setdefault("minLength", 1)
        elif kind == "array":
            node.setdefault("minItems", 1)
        elif kind == "integer":
            node.setdefault("minimum", 0)
        return node
    if isinstance(node, list):
        return [_non_empty(v) for v in node]
    return node
