"""The serving layer without Ray: app args, placement layouts, OpenAI request validation and error shapes."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

import pytest
from pydantic import ValidationError

from deployments.config import WorkerSpec, parse_args
from deployments.errors import APIError
from deployments.protocol import ChatCompletionRequest, CompletionRequest, parse_request

REPO = Path(__file__).resolve().parents[1]

# ---- app args --------------------------------------------------------------------------------------------------


def test_default_args_serve_the_embedded_model_on_cpu():
    args = parse_args({})
    assert args.model is None and args.model_name == "SmolLM2-135M-Instruct"
    assert args.worker_device == "cpu"
    layout = args.worker_layout()
    # the replica (0.5 CPU) and one bundle that the target and the drafter share, taking turns on its cores
    assert layout.bundles == [{"CPU": 0.5}, {"CPU": 1.5}] and layout.strategy == "STRICT_PACK"
    assert (layout.target.bundle_index, layout.drafter.bundle_index) == (1, 1)
    assert layout.target.num_cpus + layout.drafter.num_cpus == 1.5


def test_worker_threads_follow_the_placement():
    """On placement cpu each worker runs as many threads as the replica holds CPUs (they take turns), with or
    without a drafter; on GPUs a worker's own bundle's CPUs; an explicit count wins. Only where the workers have
    devices of their own do their calls overlap (two request groups in flight)."""
    default = parse_args({})
    assert default.worker_threads == 2 and not default.workers_overlap
    off = parse_args({"speculation": "off"})
    assert off.worker_layout().bundles == default.worker_layout().bundles and off.worker_threads == 2
    assert off.worker_layout().target.num_cpus == 1.5
    assert parse_args({"engine_num_cpus": 1, "worker_num_cpus": 3.5}).worker_threads == 8
    assert parse_args({"worker_num_cpus": 0.25}).worker_threads == 1
    gpu = parse_args({"placement": "gpu-per-worker", "worker_num_cpus": 4})
    assert gpu.worker_threads == 4 and gpu.workers_overlap
    shared = parse_args({"placement": "shared-gpu", "device": "cuda", "worker_num_cpus": 2})
    assert shared.worker_threads == 2 and not shared.workers_overlap
    assert parse_args({"worker_torch_threads": 3}).worker_threads == 3
    spec = WorkerSpec.from_args(parse_args({"placement": "gpu-per-worker"}))
    assert spec.torch_threads == 1 and spec.workers_overlap


def test_channels_poll_only_when_asked():
    """Every channel end blocks unless `channel_poll_ms` says how long to poll first (the workers get it in their
    spec); a window must be a finite number of milliseconds >= 0."""
    assert WorkerSpec.from_args(parse_args({})).channel_poll_seconds == 0.0
    gpu = {"placement": "gpu-per-worker", "engine_num_cpus": 1, "worker_num_cpus": 2}
    assert WorkerSpec.from_args(parse_args(gpu)).channel_poll_seconds == 0.0
    assert WorkerSpec.from_args(parse_args({**gpu, "channel_poll_ms": 100})).channel_poll_seconds == 0.1
    for bad in (-1, float("inf"), float("nan"), "soon"):
        with pytest.raises(ValueError, match="channel_poll_ms"):
            parse_args({"channel_poll_ms": bad})


@pytest.mark.parametrize(
    "bad",
    [
        {"placement": "tpu"},
        {"speculation": "medusa"},
        {"budget": 0},
        {"budget": "big"},
        {"budget": 128, "max_budget": 64},
        {"max_num_seqs": 0},
        {"num_replicas": 2, "autoscaling_config": {"min_replicas": 1, "max_replicas": 2}},
        {"autoscaling_config": {"min_replicas": 3, "max_replicas": 1}},
        {"device": "cuda"},  # placement cpu
        {"placement": "gpu-per-worker", "device": "cpu"},
        {"dtype": "int8"},
        {"modle": "typo"},
        {"model": "/models/Qwen3-8B"},  # no drafter for it (the shipped one is for the default model)
    ],
)
def test_bad_args_fail_before_anything_is_built(bad):
    with pytest.raises(ValidationError):
        parse_args(bad)


def test_a_custom_model_serves_with_its_drafter_or_without_speculation():
    assert parse_args({"model": "/m", "drafter": "/d"}).drafter == "/d"
    assert not parse_args({"model": "/m", "speculation": "off"}).needs_drafter


def test_a_bare_yaml_off_turns_speculation_off():
    """`speculation: off` in a Serve config reaches build_app as False (YAML 1.1); `on` stays an error."""
    import yaml

    args = yaml.safe_load("speculation: off\n")
    assert args == {"speculation": False}
    assert parse_args(args).speculation == "off" and not parse_args(args).needs_drafter
    with pytest.raises(ValidationError, match="speculation"):
        parse_args(yaml.safe_load("speculation: on\n"))


def test_args_must_be_a_dict():
    with pytest.raises(ValueError, match="dict"):
        parse_args(["model"])


def test_gpu_placements_reserve_gpus_in_one_node():
    per_worker = parse_args({"placement": "gpu-per-worker"}).worker_layout()
    assert per_worker.strategy == "STRICT_PACK"
    assert [b.get("GPU", 0) for b in per_worker.bundles] == [0, 1, 1]
    assert (per_worker.target.num_gpus, per_worker.drafter.num_gpus) == (1, 1)

    shared = parse_args({"placement": "shared-gpu", "device": "cuda"}).worker_layout()
    assert [b.get("GPU", 0) for b in shared.bundles] == [0, 1]
    assert shared.target.bundle_index == shared.drafter.bundle_index == 1
    assert shared.target.num_gpus + shared.drafter.num_gpus == 1

    no_drafter = parse_args({"placement": "gpu-per-worker", "speculation": "off"}).worker_layout()
    assert no_drafter.drafter is None and len(no_drafter.bundles) == 2


def test_served_model_name_follows_the_model_folder():
    assert parse_args({"model": "/models/Qwen3-8B/", "drafter": "/d"}).model_name == "Qwen3-8B"
    assert parse_args({"model": "/m/x", "speculation": "off", "served_model_name": "mine"}).model_name == "mine"


def test_api_key_is_not_printed():
    args = parse_args({"api_key": "s3cret"})
    assert "s3cret" not in repr(args) and args.api_key.get_secret_value() == "s3cret"


# ---- OpenAI requests -------------------------------------------------------------------------------------------


def _error(model, body) -> APIError:
    with pytest.raises(APIError) as info:
        parse_request(model, body)
    return info.value


def test_completion_request_to_sampling_params():
    req = parse_request(
        CompletionRequest,
        {
            "model": "m",
            "prompt": "hi",
            "max_tokens": 5,
            "temperature": 0,
            "top_p": 0.5,
            "stop": "\n",
            "seed": 3,
            "top_k": 4,
        },
    )
    params = req.sampling_params(default_max_tokens=16)
    assert (params.max_tokens, params.temperature, params.top_p, params.stop, params.seed, params.top_k) == (
        5,
        0.0,
        0.5,
        ["\n"],
        3,
        4,
    )
    assert parse_request(CompletionRequest, {"model": "m", "prompt": [[1, 2]]}).prompt == [[1, 2]]
    assert parse_request(CompletionRequest, {"model": "m", "prompt": [1, 2]}).prompt == [[1, 2]]
    assert parse_request(CompletionRequest, {"model": "m", "prompt": ["a", "b"]}).prompt == ["a", "b"]  # a batch
    assert _error(CompletionRequest, {"model": "m", "prompt": ["a", ""]}).param == "prompt"
    assert _error(CompletionRequest, {"model": "m", "prompt": ["a"] * 129}).param == "prompt"
    assert parse_request(CompletionRequest, {"model": "m", "prompt": "x"}).sampling_params(16).temperature == 1.0
    with pytest.raises(APIError) as info:  # what SamplingParams rejects is the client's error too
        parse_request(CompletionRequest, {"model": "m", "prompt": "x", "stop_token_ids": [-1]}).sampling_params(16)
    assert info.value.status == 400


@pytest.mark.parametrize(
    "body, param, code",
    [
        ({"model": "m", "prompt": "hi", "n": 2}, "n", "unsupported_parameter"),
        ({"model": "m", "prompt": "hi", "logprobs": 21}, "logprobs", "invalid_value"),
        ({"model": "m", "prompt": "hi", "stop": ["x"] * 17}, "stop", "invalid_value"),
        ({"model": "m", "prompt": "hi", "echo": True}, "echo", "unsupported_parameter"),
        ({"model": "m", "prompt": "hi", "presence_penalty": 0.5}, "presence_penalty", "unsupported_parameter"),
        (
            {"model": "m", "prompt": "hi", "stream_options": {"include_usage": True}},
            "stream_options",
            "unsupported_parameter",
        ),
        ({"model": "m", "prompt": "hi", "temperature": -1}, "temperature", "invalid_value"),
        ({"model": "m", "prompt": "hi", "top_p": 0}, "top_p", "invalid_value"),
        ({"model": "m", "prompt": "hi", "max_tokens": 0}, "max_tokens", "invalid_value"),
        ({"model": "m", "prompt": ["a", ""]}, "prompt", "invalid_value"),
        ({"model": "m", "prompt": ""}, "prompt", "invalid_value"),
        ({"model": "m", "prompt": [True, 2]}, "prompt.0", "invalid_value"),  # not token 1 (the element named)
        ({"model": "m", "prompt": [1.0, 2]}, "prompt.0", "invalid_value"),
        ({"model": "m", "prompt": "hi", "speculation": "off"}, "speculation", "unrecognized_parameter"),
        ({"model": "m"}, "prompt", "missing_parameter"),
        # strict types, as OpenAI's: pydantic's lax mode would read these as 1, 1, True, False, 0.5, [1]
        ({"model": "m", "prompt": "hi", "max_tokens": True}, "max_tokens", "invalid_value"),
        ({"model": "m", "prompt": "hi", "seed": True}, "seed", "invalid_value"),
        ({"model": "m", "prompt": "hi", "stream": "yes"}, "stream", "invalid_value"),
        ({"model": "m", "prompt": "hi", "ignore_eos": "false"}, "ignore_eos", "invalid_value"),
        ({"model": "m", "prompt": "hi", "top_p": "0.5"}, "top_p", "invalid_value"),
        ({"model": "m", "prompt": "hi", "stop_token_ids": [True]}, "stop_token_ids.0", "invalid_value"),
        ({"model": "m", "prompt": "hi", "top_k": -2}, "top_k", "invalid_value"),
        ({"model": "m", "prompt": "hi", "best_of": "1"}, "best_of", "invalid_value"),
        ({"model": "m", "prompt": "hi", "logit_bias": {"5": "1"}}, "logit_bias", "invalid_value"),
    ],
)
def test_bad_completion_requests_name_the_parameter(body, param, code):
    err = _error(CompletionRequest, body)
    assert (err.status, err.param, err.code, err.type) == (400, param, code, "invalid_request_error")
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}


def test_integers_are_floats_and_top_k_minus_one_is_off():
    body = parse_request(CompletionRequest, {"model": "m", "prompt": "hi", "temperature": 1, "top_p": 1, "top_k": -1})
    params = body.sampling_params(16)
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 1.0, 0)  # vLLM's -1: off, as 0
    chat = parse_request(
        ChatCompletionRequest,
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2},
    )
    assert chat.sampling_params(16).logprobs == 2
    with pytest.raises(APIError):
        parse_request(
            ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": 1}
        )


@pytest.mark.parametrize("prompt", [123, None, b"hi", [True], ["a"], (1.0,)])
def test_python_handle_prompts_that_are_not_text_or_token_ids_are_client_errors(prompt):
    from deployments.engine_request import EngineRequest

    with pytest.raises(ValueError, match="prompt"):
        EngineRequest(prompt=prompt)


def test_logprobs_requests_and_bodies():
    from ddtree.outputs import TokenLogprobs
    from deployments.responses import UsageInfo, chat_body, completion_body

    def params(model, body):
        return parse_request(model, {"model": "m", **body}).sampling_params(16).logprobs

    assert params(CompletionRequest, {"prompt": "x", "logprobs": 2}) == 2
    assert params(CompletionRequest, {"prompt": "x"}) is None
    chat = {"messages": [{"role": "user", "content": "x"}]}
    assert params(ChatCompletionRequest, {**chat, "logprobs": True, "top_logprobs": 3}) == 3
    assert params(ChatCompletionRequest, {**chat, "logprobs": True}) == 0
    assert params(ChatCompletionRequest, {**chat, "logprobs": False}) is None
    err = _error(ChatCompletionRequest, {"model": "m", **chat, "top_logprobs": 2})
    assert (err.status, err.param) == (400, "top_logprobs") and "logprobs=true" in err.message
    assert (
        _error(ChatCompletionRequest, {"model": "m", **chat, "logprobs": True, "top_logprobs": 21}).param
        == "top_logprobs"
    )

    lps = [TokenLogprobs(5, "Hi", -0.1, [(5, "Hi", -0.1), (6, "Hey", -2.5)]), TokenLogprobs(7, "!", -0.3, [])]
    usage = UsageInfo(1, 2, {})
    choice = completion_body("id", "m", [("Hi!", "stop", lps)], usage)["choices"][0]
    assert choice["logprobs"] == {
        "tokens": ["Hi", "!"],
        "token_logprobs": [-0.1, -0.3],
        "top_logprobs": [{"Hi": -0.1, "Hey": -2.5}, {"!": -0.3}],
        "text_offset": [0, 2],
    }
    content = chat_body("id", "m", "Hi!", "stop", usage, lps)["choices"][0]["logprobs"]["content"]
    assert content[0] == {
        "token": "Hi",
        "logprob": -0.1,
        "bytes": [72, 105],
        "top_logprobs": [
            {"token": "Hi", "logprob": -0.1, "bytes": [72, 105]},
            {"token": "Hey", "logprob": -2.5, "bytes": [72, 101, 121]},
        ],
    }
    assert chat_body("id", "m", "Hi!", "stop", usage)["choices"][0]["logprobs"] is None
    # the generated token joins the top entries when it is not among them (OpenAI: up to logprobs + 1)
    sampled = [TokenLogprobs(6, "Hey", -2.5, [(5, "Hi", -0.1)])]
    assert completion_body("id", "m", [("Hey", "length", sampled)], usage)["choices"][0]["logprobs"][
        "top_logprobs"
    ] == [{"Hi": -0.1, "Hey": -2.5}]
    assert params(CompletionRequest, {"prompt": "x", "logprobs": False}) is None
    assert _error(CompletionRequest, {"model": "m", "prompt": "x", "logprobs": True}).param == "logprobs"


def test_streamed_logprobs_equal_the_whole_responses():
    """Chunks carry the log-probabilities of the tokens since the last chunk, with the offsets of the whole text."""
    from ddtree.outputs import TokenLogprobs
    from deployments.responses import StreamLogprobs, completion_logprobs

    lps = [TokenLogprobs(i, text, -1.0 * i) for i, text in enumerate(["Hello", " wor", "k", "!"])]
    stream = StreamLogprobs(chat=False)
    chunks = []
    for new in ([lps[0], lps[1]], [lps[2]], [], [lps[3]]):  # " wor" held back with the first chunk's text
        stream.add(new)
        chunks.append(stream.take())
    whole = completion_logprobs(lps)
    assert [o for c in chunks for o in c["text_offset"]] == whole["text_offset"] == [0, 5, 9, 10]
    assert [t for c in chunks for t in c["tokens"]] == whole["tokens"]
    chat = StreamLogprobs(chat=True)
    chat.add(lps[:2])
    assert [e["token"] for e in chat.take()["content"]] == ["Hello", " wor"] and chat.take() == {"content": []}


def test_logprobs_of_tokens_splitting_a_character_carry_its_bytes_and_offsets():
    """ "é🎉!" as byte-level tokens [é][🎉's first two bytes][its last two][!]: each part's own text is U+FFFD, its
    bytes the part, so chat `bytes` join into the text's UTF-8; completion offsets count characters of the text,
    the emoji's two tokens both starting at its offset (streamed in any chunks: the same)."""
    from ddtree.outputs import TokenLogprobs
    from deployments.responses import StreamLogprobs, chat_logprobs, completion_logprobs

    parts = ["é".encode(), "🎉".encode()[:2], "🎉".encode()[2:], b"!"]
    lps = [
        TokenLogprobs(i, raw.decode(errors="replace"), -1.0, [(i, raw.decode(errors="replace"), -1.0)], raw, [raw])
        for i, raw in enumerate(parts)
    ]
    content = chat_logprobs(lps)["content"]
    assert b"".join(bytes(e["bytes"]) for e in content).decode() == "é🎉!"
    assert [bytes(e["top_logprobs"][0]["bytes"]) for e in content] == parts
    assert completion_logprobs(lps)["text_offset"] == [0, 1, 1, 2]
    stream = StreamLogprobs(chat=False)
    offsets = []
    for new in ([lps[0], lps[1]], [lps[2], lps[3]]):
        stream.add(new)
        offsets += stream.take()["text_offset"]
    assert offsets == [0, 1, 1, 2]


def test_text_offsets_after_an_abandoned_byte_sequence():
    """A token leaving an incomplete UTF-8 sequence that the next token does not continue (garbage bytes): the
    sequence becomes U+FFFD in the text, at the first token's offset, and the next token starts after it."""
    from ddtree.outputs import TokenLogprobs
    from deployments.responses import completion_logprobs

    parts = [b"a", b"\xe2\x82", b"b", b"\xf0", "🎉".encode(), b"c"]
    text = b"".join(parts).decode(errors="replace")
    assert text == "a\ufffdb\ufffd🎉c"
    lps = [TokenLogprobs(i, raw.decode(errors="replace"), -1.0, [], raw, []) for i, raw in enumerate(parts)]
    assert completion_logprobs(lps)["text_offset"] == [0, 1, 2, 3, 4, 5]
    offsets = completion_logprobs(lps)["text_offset"]
    assert [text[o] for o in offsets] == ["a", "\ufffd", "b", "\ufffd", "🎉", "c"]


def test_chat_request_messages_and_limits():
    req = parse_request(
        ChatCompletionRequest,
        {
            "model": "m",
            "max_completion_tokens": 7,
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ],
        },
    )
    # text parts joined by a newline, as vLLM joins them
    assert req.template_messages() == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"}]
    assert req.sampling_params(default_max_tokens=99).max_tokens == 7
    # a part of another type is named as such (not "content should be a valid string")
    err = _error(
        ChatCompletionRequest,
        {
            "model": "m",
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}],
                }
            ],
        },
    )
    assert err.param == "messages.0.content.1.type" and "'text'" in err.message
    # vLLM's extensions at their neutral values are accepted, other values refused by name; so is a zero logit_bias
    neutral = {
        "repetition_penalty": 1.0,
        "min_tokens": 0,
        "skip_special_tokens": True,
        "include_stop_str_in_output": False,
        "logit_bias": {"5": 0},
    }
    parse_request(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}], **neutral})
    for param, value in (
        ("repetition_penalty", 1.1),
        ("min_tokens", 3),
        ("skip_special_tokens", False),
        ("include_stop_str_in_output", True),
        ("logit_bias", {"5": 2.0}),
    ):
        err = _error(
            ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}], param: value}
        )
        assert (err.param, err.code) == (param, "unsupported_parameter")
    err = _error(
        ChatCompletionRequest,
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": float("nan")},
    )
    assert err.param == "temperature" and "finite" in err.message
    assert _error(ChatCompletionRequest, {"model": "m", "messages": []}).param == "messages"
    assert _error(ChatCompletionRequest, {"model": "m", "messages": [{"role": "tool", "content": "x"}]}).status == 400
    assert (
        _error(
            ChatCompletionRequest,
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
        ).param
        == "tools"
    )


def test_an_echoed_assistant_message_is_accepted_when_its_extra_fields_are_empty():
    """Clients send a previous response's message back as is (`refusal: null`, `tool_calls: []`, ...)."""
    echoed = {
        "role": "assistant",
        "content": "hi",
        "refusal": None,
        "tool_calls": [],
        "annotations": [],
        "audio": None,
        "function_call": None,
    }
    req = parse_request(
        ChatCompletionRequest,
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hello"}, echoed, {"role": "user", "content": "again"}],
        },
    )
    assert req.template_messages()[1] == {"role": "assistant", "content": "hi"}
    called = {**echoed, "tool_calls": [{"id": "c1", "type": "function"}]}
    assert _error(ChatCompletionRequest, {"model": "m", "messages": [called]}).status == 400


def test_api_error_survives_pickling():
    err = pickle.loads(pickle.dumps(APIError(429, "full", "rate_limit_error", None, "engine_queue_full", 1)))
    assert err.status == 429 and err.body() == {
        "error": {"message": "full", "type": "rate_limit_error", "param": None, "code": "engine_queue_full"}
    }
    assert err.headers() == {"Retry-After": "1"} and APIError(400, "bad", "invalid_request_error").headers() == {}


def test_a_failed_engine_answers_a_retriable_503():
    from deployments.engine_loop import EngineDeadError
    from deployments.engine_request import EngineRequest
    from deployments.engine_server import _as_api_error

    request = object.__new__(EngineRequest)
    error = _as_api_error(EngineDeadError("the target actor died and a new one failed to start"), request)
    assert (error.status, error.code, error.headers()) == (503, "engine_unavailable", {"Retry-After": "5"})


# ---- the built application (no Ray start needed to build) -------------------------------------------------------


def _engine_deployment(app):
    """(the deployment serving HTTP, the one running the engine): the same with ingress "engine"."""
    ingress = app._bound_deployment
    if ingress.name == "DDTreeServer":
        return ingress, ingress
    return ingress, ingress.init_args[0]._bound_deployment


def test_build_app_sets_placement_and_autoscaling_of_the_engine():
    from deployments.app import build_app

    ingress, engine = _engine_deployment(
        build_app(
            {
                "placement": "gpu-per-worker",
                "max_num_seqs": 32,
                "max_waiting": 64,
                "ingress": "separate",
                "autoscaling_config": {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 32},
            }
        )
    )
    assert (ingress.name, engine.name) == ("OpenAIIngress", "DDTreeEngine")
    # Serve must pass every request to the engine, whose own queue answers 429.
    assert engine.max_ongoing_requests >= 32 + 64
    assert engine.ray_actor_options["num_cpus"] == 0.5
    # Ray Serve keeps these in private fields; they are what the cluster will be asked for.
    assert engine._replica_config.placement_group_bundles == [
        {"CPU": 0.5},
        {"CPU": 0.75, "GPU": 1.0},
        {"CPU": 0.75, "GPU": 1.0},
    ]
    assert engine._replica_config.placement_group_strategy == "STRICT_PACK"
    assert engine._deployment_config.autoscaling_config.max_replicas == 3

    _, fixed = _engine_deployment(build_app({"num_replicas": 2, "speculation": "off", "ingress": "separate"}))
    assert fixed.num_replicas == 2 and len(fixed._replica_config.placement_group_bundles) == 2
    # ingress "engine" (the default): the same engine options on the one deployment that serves HTTP too
    server = build_app(
        {"placement": "gpu-per-worker", "autoscaling_config": {"min_replicas": 1, "max_replicas": 3}}
    )._bound_deployment
    assert server.name == "DDTreeServer" and server.ray_actor_options["num_cpus"] == 0.5
    assert server._replica_config.placement_group_bundles == engine._replica_config.placement_group_bundles
    assert server._deployment_config.autoscaling_config.target_ongoing_requests == 16  # max_num_seqs
    assert server._deployment_config.user_config == {"served_model_name": None, "default_max_tokens": None}


def test_a_chat_template_that_refuses_the_messages_is_a_client_error():
    from deployments.engine_server import chat_prompt_token_ids
    from tests.tiny_tokenizer import make_char_tokenizer

    tokenizer = make_char_tokenizer()
    assert chat_prompt_token_ids(tokenizer, [{"role": "user", "content": "hi"}])
    tokenizer.chat_template = (  # as Mistral's and Gemma's templates do for a system message
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system messages') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}"
    )
    with pytest.raises(ValueError, match="no system messages"):
        chat_prompt_token_ids(tokenizer, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])


def test_null_optional_fields_take_their_defaults():
    nulls = {
        k: None
        for k in (
            "temperature",
            "top_p",
            "n",
            "stream",
            "frequency_penalty",
            "presence_penalty",
            "top_k",
            "ignore_eos",
            "stop",
            "seed",
            "max_tokens",
            "stream_options",
        )
    }
    req = parse_request(CompletionRequest, {"model": "m", "prompt": "hi", **nulls})
    params = req.sampling_params(default_max_tokens=16)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens, params.stop) == (1.0, 1.0, 0, 16, [])
    assert req.n == 1 and req.stream is False
    chat = parse_request(
        ChatCompletionRequest,
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": None, "stream": None},
    )
    assert chat.temperature == 1.0 and chat.stream is False
    err = _error(CompletionRequest, {"model": "m", "prompt": None})  # required fields stay required
    assert (err.status, err.param) == (400, "prompt")


def test_disagreeing_token_limits_name_the_parameter():
    err = _error(
        ChatCompletionRequest,
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "max_completion_tokens": 6},
    )
    assert (err.status, err.param, err.code) == (400, "max_completion_tokens", "invalid_value")
    assert "disagree" in err.body()["error"]["message"] and "None" not in err.body()["error"]["message"]


def test_what_crosses_between_actors_round_trips_exactly():
    """Trees, features and drafts travel between the engine and the worker actors as numpy arrays and lists
    (a torch tensor costs ~0.3 ms to pickle through Ray): every value, dtype (bfloat16 included) and the None /
    empty trees survive, through a real pickle as Ray does it."""
    import torch

    from ddtree.tree import DraftTree, build_tree
    from deployments.worker_ops import tensor_from_wire, tensor_to_wire, trees_from_wire, trees_to_wire

    gen = torch.Generator().manual_seed(0)
    trees = [
        build_tree(torch.log_softmax(torch.randn(4, 9, generator=gen), -1), 6),
        None,
        DraftTree.empty(),
        build_tree(torch.log_softmax(torch.randn(3, 9, generator=gen), -1), 3),
    ]
    back = trees_from_wire(pickle.loads(pickle.dumps(trees_to_wire(trees))))
    assert back[1] is None and back[2].num_nodes == 0
    for sent, got in zip(trees, back):
        if sent is not None:
            for field in ("token_ids", "parents", "depths", "path_logprobs"):
                assert torch.equal(getattr(sent, field), getattr(got, field))
                assert getattr(sent, field).dtype == getattr(got, field).dtype
    assert trees_from_wire(trees_to_wire([None, None])) == [None, None]
    for t in (
        torch.randn(5, 7, generator=gen),
        torch.randn(3, 2, dtype=torch.float64, generator=gen),
        torch.randn(4, 6, generator=gen).bfloat16(),
        torch.arange(12).view(3, 4),
    ):
        got = tensor_from_wire(pickle.loads(pickle.dumps(tensor_to_wire(t))))
        assert got.dtype == t.dtype and torch.equal(got, t)
        got.add_(1)  # writable: not a view of the (read-only) received buffer


def test_the_worker_codec_carries_a_rounds_messages_exactly_and_pickles_the_rest():
    """WireCodec: Verify and Draft and the replies with their results travel as msgpack (their own tags), every
    value, dtype and shape intact (bfloat16 top-K, logprobs, trees None and empty); any other message, a failure's
    exception included, travels as a pickle, and so does a round's message with a value msgpack cannot carry; bytes
    with an unknown tag are refused."""
    import numpy as np
    import torch

    from ddtree.tree import DraftTree, build_tree
    from ddtree.workers import PrefillResult, RawLogprobs, VerifyResult
    from deployments.channel import PICKLE
    from deployments.worker_ops import (
        WIRE,
        Draft,
        DraftTopK,
        Free,
        Reply,
        Verify,
        tensor_from_wire,
        tensor_to_wire,
        trees_from_wire,
        trees_to_wire,
    )

    def through(message):
        data = WIRE.encode(message)
        return data[0], WIRE.decode(bytearray(data))

    gen = torch.Generator().manual_seed(1)
    trees = [build_tree(torch.log_softmax(torch.randn(4, 9, generator=gen), -1), 6), None, DraftTree.empty()]
    verify = Verify(["a", "b", "c"], trees_to_wire(trees), [5, 6, 7], ["a"])
    tag, got = through(verify)
    assert tag != 0 and (got.request_ids, got.roots, got.feature_request_ids) == (["a", "b", "c"], [5, 6, 7], ["a"])
    back = trees_from_wire(got.trees)
    assert back[1] is None and back[2].num_nodes == 0
    for field in ("token_ids", "parents", "depths", "path_logprobs"):
        assert torch.equal(getattr(back[0], field), getattr(trees[0], field))
        assert getattr(back[0], field).dtype == getattr(trees[0], field).dtype
    plain = Verify(["a"], trees_to_wire([None]), [3], [])  # a plain round's (no tensor work on either side)
    assert trees_from_wire(through(plain)[1].trees) == [None]
    with_prompts = Verify(["a"], trees_to_wire([None]), [3], [], ["d", "e"], [[1, 2, 3], [4]])
    tag, got = through(with_prompts)
    assert tag != 0 and (got.prompt_ids, got.prompts) == (["d", "e"], [[1, 2, 3], [4]])

    draft = Draft(["a", "b"], [1, 2], 16, 7)
    assert through(draft)[0] != 0 and through(draft)[1] == draft

    logprobs = [RawLogprobs([-0.5, -1.25], [[3, 4], [5, 6]], [[-0.5, -2.0], [-1.25, -1.5]]), None]
    result = VerifyResult([[11, 12], []], [13, 14], 9, 0.02, 0.001, logprobs)
    tag, got = through(Reply(result, 0.025, 3, 123.5, 4096))
    assert tag != 0 and got == Reply(result, 0.025, 3, 123.5, 4096)
    result.prefilled = PrefillResult([21, 22], [None, RawLogprobs([-0.1], [[21, 2]], [[-0.1, -3.0]])])
    tag, got = through(Reply(result, 0.025, 3, 123.5, 4096))
    assert tag != 0 and got == Reply(result, 0.025, 3, 123.5, 4096)

    topk = torch.randn(2, 8, 4, generator=gen).bfloat16(), torch.randint(0, 50, (2, 8, 4), generator=gen)
    tag, got = through(Reply(DraftTopK(*(tensor_to_wire(t) for t in topk)), 0.009, 0, 99.0))
    assert tag != 0 and (got.seconds, got.started_at) == (0.009, 99.0)
    for sent, wire in zip(topk, (got.result.logprobs, got.result.token_ids)):
        received = tensor_from_wire(wire)
        assert received.dtype == sent.dtype and torch.equal(received, sent)

    odd = Reply(VerifyResult([[np.int64(11)]], [13], 2, 0.02, 0.001, [None]), 0.025)  # msgpack cannot carry it
    for other in (Free("a"), Reply(None, 0.001), Reply([(1, 0.01)], 0.5), KeyError("x"), odd):
        tag, got = through(other)
        assert tag == 0 and type(got) is type(other) and repr(got) == repr(other)
    with pytest.raises(ValueError, match="not a worker message"):
        WIRE.decode(bytearray(b"\x09"))
    assert PICKLE.decode(bytearray(PICKLE.encode(verify))).roots == [5, 6, 7]


@pytest.mark.parametrize(
    "accept, wants",
    [
        (["application/msgpack"], True),
        (["application/json, application/msgpack;q=0.1"], False),  # JSON ranked higher
        (["application/msgpack, */*;q=0.5"], True),
        (["application/json", "application/msgpack"], True),  # two header lines, tied
        (["application/msgpack;q=0."], False),
        (["application/msgpack;q=00"], False),
        (["application/msgpack;q=-1"], False),
        (["application/msgpack;q=oops"], True),  # a malformed q counts as 1
        (["*/*"], False),
        ([], False),
    ],
)
def test_msgpack_answers_follow_the_accept_header_q_values(accept, wants):
    from starlette.requests import Request

    from deployments.ingress import _wants_msgpack

    request = Request({"type": "http", "headers": [(b"accept", a.encode()) for a in accept]})
    assert _wants_msgpack(request) is wants


def test_autoscaling_and_worker_settings_are_checked_and_defaulted():
    from deployments.app import build_app

    with pytest.raises(ValueError, match=r"unknown key\(s\) \['max_replica'\]"):
        build_app({"autoscaling_config": {"min_replicas": 1, "max_replica": 4}})
    _, engine = _engine_deployment(build_app({"max_num_seqs": 24, "autoscaling_config": {"max_replicas": 2}}))
    assert engine._deployment_config.autoscaling_config.target_ongoing_requests == 24  # not Serve's 2
    _, engine = _engine_deployment(build_app({"autoscaling_config": {"max_replicas": 2, "target_ongoing_requests": 5}}))
    assert engine._deployment_config.autoscaling_config.target_ongoing_requests == 5
    with pytest.raises(ValueError, match="attention"):
        build_app({"attention": "flexx"})
    with pytest.raises(ValueError, match="only the GPU"):
        build_app({"placement": "gpu-per-worker", "device": "cuda:1"})


def test_a_request_that_timed_out_in_the_queue_is_a_retriable_503():
    """The engine's "queue_timeout" output (a request never admitted) reaches the caller as a 503 with Retry-After,
    in place of an empty answer."""
    import asyncio

    from ddtree.outputs import RequestOutput, RequestStats
    from deployments.config import parse_args
    from deployments.engine_request import EngineRequest
    from deployments.engine_server import DDTreeEngine

    class Loop:
        async def stream(self, prompt, params, request_id, interval_s):
            yield RequestOutput(
                request_id="r",
                prompt_token_ids=[1],
                text="",
                token_ids=[],
                new_text="",
                new_token_ids=[],
                finished=True,
                finish_reason="queue_timeout",
                stats=RequestStats(),
            )

        def stop(self):  # (the replica's __del__)
            pass

    server = object.__new__(DDTreeEngine)
    server.args, server.loop = parse_args({"max_queue_seconds": 7}), Loop()

    async def prompt_token_ids(request):
        return [1]

    server._prompt_token_ids = prompt_token_ids
    request = object.__new__(EngineRequest)
    request.params, request.request_id = None, "r"
    error = asyncio.run(server.generate(request))
    assert isinstance(error, APIError) and (error.status, error.code) == (503, "queue_timeout")
    assert error.headers() == {"Retry-After": "5"} and "7 s" in error.message


def test_health_check_gives_up_on_a_hung_worker_and_on_a_target_it_cannot_replace():
    """check_health fails when a round runs past max_round_seconds, and abandons the engine loop first (its
    requests fail at once, so that the replica's graceful stop has nothing to wait for). A dead drafter is not a
    failure, nor is a dead target by itself: the engine is told it lost its target and a new one starts
    (tests/test_serve.py: requests then go on). Where that start fails, the requests fail with EngineDeadError (a
    retriable 503) and the next check fails the replica."""
    import asyncio

    from deployments.config import parse_args
    from deployments.engine_loop import EngineDeadError
    from deployments.engine_server import DDTreeEngine

    class Engine:
        target_lost, drafter_lost, requests = None, None, {}

        def lose_target(self, exc):
            self.target_lost = str(exc)

    class Loop:
        is_alive, error, seconds_in_round = True, None, 0.0

        def __init__(self):
            self.abandoned = []

        def abandon(self, exc):
            self.abandoned.append(exc)

        async def call(self, fn):
            return fn(server.engine)

        def stop(self):  # (the replica's __del__)
            pass

    class Actors:
        dead, drafter = None, None  # (no drafter: nothing to restart)

        async def find_dead(self, names=("target", "drafter")):
            return self.dead if self.dead is not None and self.dead.split()[1] in names else None

        def start_workers(self, timeout_s):
            raise RuntimeError("no room for a new target actor")

        def kill(self):
            pass

    server = object.__new__(DDTreeEngine)
    server.args, server.loop, server.actors, server.engine = (
        parse_args({"max_round_seconds": 5}),
        Loop(),
        Actors(),
        Engine(),
    )
    server._drafter_restart = server._workers_restart = server._workers_restart_error = None

    async def scenario():
        await server.check_health()  # healthy: nothing abandoned
        assert server.loop.abandoned == []
        server.loop.seconds_in_round = 6.0
        with pytest.raises(RuntimeError, match="a worker is hung"):
            await server.check_health()
        server.loop.seconds_in_round, server.actors.dead = 0.0, "the drafter actor died: gone"
        await server.check_health()
        assert len(server.loop.abandoned) == 1
        server.actors.dead = "the target actor died: gone"
        await server.check_health()  # a new target starts; the requests wait for it
        assert server.engine.target_lost == "the target actor died: gone" and len(server.loop.abandoned) == 1
        await server._workers_restart  # ... and fails to start
        assert "failed to start" in str(server.loop.abandoned[-1])
        with pytest.raises(RuntimeError, match="failed to start"):
            await server.check_health()

    asyncio.run(scenario())
    assert [type(e) for e in server.loop.abandoned] == [EngineDeadError] * 3
    server.actors.dead, server.loop.is_alive = None, False  # the loop thread stopped: abandoned too (idempotent)
    with pytest.raises(RuntimeError, match="engine loop stopped"):
        asyncio.run(server.check_health())
    assert len(server.loop.abandoned) == 4


def test_the_ingress_settings_change_in_place_over_the_args():
    """The served name, API key and default_max_tokens ride the ingress's user_config (an in-place update: Serve
    calls reconfigure, no replica restarts); a user_config in ray_config.yaml overrides only the keys it names."""
    from deployments.app import build_app
    from deployments.config import IngressSettings, parse_args

    args = parse_args({"api_key": "k1", "default_max_tokens": 64, "speculation": "off"})
    ingress, _ = _engine_deployment(build_app(args))
    # (the key stays out of it: Serve shows user_config in its details)
    assert ingress._deployment_config.user_config == {"served_model_name": None, "default_max_tokens": 64}
    settings = IngressSettings.of(args, {"default_max_tokens": 128})  # the key is kept
    assert settings.default_max_tokens == 128 and settings.api_key.get_secret_value() == "k1"
    assert IngressSettings.of(args, {"api_key": "k2"}).api_key.get_secret_value() == "k2"
    with pytest.raises(ValueError, match="api_kee"):
        IngressSettings.of(args, {"api_kee": "k2"})
    with pytest.raises(ValueError, match="default_max_tokens"):
        IngressSettings.of(args, {"default_max_tokens": 0})


def test_a_bad_ingress_user_config_is_logged_and_changes_nothing(caplog):
    """Raising in reconfigure would make Serve stop the ingress replica and fail its replacements (the whole API
    down for a typo in ray_config.yaml): the settings stay as they were and the error is logged."""
    from deployments.config import IngressSettings
    from deployments.ingress import OpenAIIngress

    ingress = object.__new__(OpenAIIngress)  # (its FastAPI wrapper's __init__ needs Serve running)
    ingress.args = parse_args({"api_key": "k1", "default_max_tokens": 64})
    ingress._apply(IngressSettings.of(ingress.args))
    ingress.reconfigure({"default_max_tokens": 8})
    assert ingress.default_max_tokens == 8 and ingress._api_key == b"k1"
    ingress.reconfigure({"api_kee": "k2"})
    ingress.reconfigure({"api_key": 12345})  # an unquoted number in YAML
    assert ingress.default_max_tokens == 8 and ingress._api_key == b"k1"
    assert "user_config refused" in caplog.text


def test_a_stream_whose_client_left_before_its_body_is_aborted_on_an_in_process_engine():
    """A streaming answer's background task (run by Starlette after the response, also when the client went away
    before the body started, so that `_sse` never ran) aborts its engine requests. With the engine in the API's
    process (`ingress: engine`, the default) that is closing the engine's async generator on the event loop: the
    task runs there, with no exception, and the generator's `finally` (the abort) runs."""
    import asyncio
    from types import SimpleNamespace

    from deployments.ingress import OpenAIIngress
    from deployments.server import _LocalStream

    closed = []

    async def engine_stream(request_id):
        try:
            yield SimpleNamespace(request_id=request_id)
            await asyncio.sleep(3600)  # (a request still decoding)
        finally:
            closed.append(request_id)

    class Engine:
        def options(self, stream):
            return SimpleNamespace(generate_stream=SimpleNamespace(remote=lambda r: _LocalStream(engine_stream(r))))

    async def main():
        ingress = object.__new__(OpenAIIngress)
        ingress.engine = Engine()
        body = SimpleNamespace(stream=True)
        response = await ingress._respond(None, body, "cmpl-1", ["r0", "r1"], chat=True)
        await response.background()  # what Starlette runs once the response is over
        for _ in range(5):
            await asyncio.sleep(0)
        return closed

    assert sorted(asyncio.run(main())) == ["r0", "r1"]


def test_the_serve_runner_polls_the_first_apps_health_and_refuses_a_bad_config(tmp_path, capsys):
    """`make serve`'s runner (deployments/run.py): the URL it polls and prints follows the config's HTTP options
    and route prefix (0.0.0.0 is polled on loopback); a config it cannot use is refused before anything starts."""
    from deployments.run import health_url, main

    assert (
        health_url({"http_options": {"host": "0.0.0.0", "port": 8123}, "applications": [{"route_prefix": "/ddtree/"}]})
        == "http://127.0.0.1:8123/ddtree"
    )
    assert health_url({"applications": [{}]}) == "http://127.0.0.1:8000"
    bad = tmp_path / "bad.yaml"
    bad.write_text("applications: []\n")
    assert main([str(bad)]) == 2 and "has no applications" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.yaml")]) == 2 and "cannot read" in capsys.readouterr().err


def test_the_serve_runner_serves_one_replica_by_direct_ingress_on_the_configs_port():
    """`make serve`'s runner hands HTTP to the replica itself (Serve's direct ingress) where one application of one
    ingress replica runs on a Ray of its own, and leaves Serve's proxy in front wherever that would not hold: a
    cluster's Ray, the user's own choice, several applications or replicas, a config that is not this project's."""
    import yaml

    from deployments.run import direct_ingress, serves_directly

    config = yaml.safe_load((REPO / "ray_config.yaml").read_text())
    assert serves_directly(config, {})
    served, env = direct_ingress(config, {"PATH": "/bin"}, proxy_port=43210)
    assert served["http_options"] == {"host": "0.0.0.0", "port": 43210}  # Serve's proxy moves off the port
    assert config["http_options"]["port"] == 8000  # (the user's config is left as it is)
    assert served["applications"] == config["applications"]
    assert env["PATH"] == "/bin" and env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    # the replica may take the config's port only (Serve's range leaves its maximum out), freed at once
    assert (env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"], env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]) == (
        "8000",
        "8001",
    )
    assert env["RAY_SERVE_PORT_QUARANTINE_S"] == "0" and env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "0"

    assert not serves_directly(config, {"RAY_ADDRESS": "10.0.0.1:6379"})
    assert not serves_directly(config, {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"})
    assert not serves_directly(config, {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"})  # the user's own settings: as set

    def with_args(**args):
        changed = copy.deepcopy(config)
        changed["applications"][0]["args"].update(args)
        return changed

    assert serves_directly(with_args(ingress="separate"), {})
    assert not serves_directly(with_args(num_replicas=2), {})
    assert not serves_directly(with_args(autoscaling_config={"min_replicas": 1, "max_replicas": 3}), {})
    assert not serves_directly(with_args(ingress="separate", num_ingress_replicas=2), {})
    assert not serves_directly(with_args(speculation="sometimes"), {})  # serve run reports the bad arg
    two = copy.deepcopy(config)
    two["applications"].append({**config["applications"][0], "name": "other", "route_prefix": "/other"})
    assert not serves_directly(two, {})
    other = copy.deepcopy(config)
    other["applications"][0]["import_path"] = "loadtest.hf_baseline:build_app"
    assert not serves_directly(other, {})


def test_the_api_key_is_compared_in_constant_time(monkeypatch):
    """Every check of a key goes through hmac.compare_digest (its time does not depend on where the keys first
    differ, so the key cannot be guessed a byte at a time from response times), whatever the key sent: a prefix,
    a longer one, one wrong in its last byte, an empty one. Only the exact key passes."""
    import hmac

    from starlette.requests import Request

    from deployments import ingress as ingress_module
    from deployments.config import IngressSettings
    from deployments.errors import APIError
    from deployments.ingress import OpenAIIngress

    calls, compare_digest = [], hmac.compare_digest

    def spy(a, b):
        calls.append((bytes(a), bytes(b)))
        return compare_digest(a, b)

    monkeypatch.setattr(ingress_module.hmac, "compare_digest", spy)
    ingress = object.__new__(OpenAIIngress)
    ingress.args = parse_args({"api_key": "s3cret-key"})
    ingress._apply(IngressSettings.of(ingress.args))

    def authorize(token: str) -> bool:
        request = Request({"type": "http", "headers": [(b"authorization", f"Bearer {token}".encode("latin-1"))]})
        try:
            ingress._authorize(request)
        except APIError as exc:
            assert exc.status == 401
            return False
        return True

    tried = ["s3cret", "s3cret-key-and-more", "s3cret-kez", "", "S3CRET-KEY", "é" * 10]
    assert [authorize(t) for t in tried] == [False] * len(tried)
    assert authorize("s3cret-key")
    assert len(calls) == len(tried) + 1 and all(b == b"s3cret-key" for _, b in calls)


def test_the_engine_settings_have_one_source():
    """Every EngineConfig field is an app arg and an LLM argument, with EngineConfig's default (the app: where
    SERVE_DEFAULTS says otherwise): a field added to one and not the others fails here."""
    import dataclasses
    import inspect

    from ddtree.config import SERVE_DEFAULTS, EngineConfig
    from ddtree.llm import LLM
    from deployments.config import AppArgs, parse_args

    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    assert set(SERVE_DEFAULTS) <= set(defaults)
    app_fields = AppArgs.model_fields
    llm_params = inspect.signature(LLM.__init__).parameters
    for name, default in defaults.items():
        assert name in app_fields and app_fields[name].default == SERVE_DEFAULTS.get(name, default), name
        assert name in llm_params and llm_params[name].default == default, name
    assert parse_args({}).engine_config() == EngineConfig(**SERVE_DEFAULTS)
    args = parse_args({"speculation": "off", "max_waiting": 3, "pipeline": False, "max_queue_seconds": None})
    assert args.engine_config() == EngineConfig(speculation="off", max_waiting=3, pipeline=False)


def test_the_serve_runner_waits_for_a_port_still_held_before_direct_ingress():
    """A direct-ingress replica binds its one port without SO_REUSEADDR, and one that cannot is stopped with the port
    blocked, so the app would never start: the runner first waits for the port (a server stopped moments before
    leaves it in TIME_WAIT for up to 60 s), saying so once, and gives up after the timeout."""
    import socket

    from deployments.run import wait_for_port

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    waits = []
    assert not wait_for_port("127.0.0.1", port, 0.3, lambda: waits.append(1), poll_s=0.05)
    assert waits == [1]
    holder.close()
    assert wait_for_port("127.0.0.1", port, 0.3, lambda: waits.append(2), poll_s=0.05)
    assert waits == [1]  # free at once: no wait announced
