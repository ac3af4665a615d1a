"""The Serve application end to end on CPU: built from ray_config.yaml (model overridden to a tiny random pair), started
once per test session, called with the official `openai` client, raw HTTP and the Python handle API. T=0 answers must
equal the offline `LLM`'s."""

from __future__ import annotations

import contextlib
import importlib
import os
import random
import re
import socket
import threading
import time
from pathlib import Path

import pytest
import requests
import yaml

from ddtree import SamplingParams
from tests.factories import make_tiny_drafter, make_tiny_target

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Ray's own pydantic v1-style fields

REPO = Path(__file__).resolve().parents[1]
APP_NAME = "ddtree"
MODEL_NAME = "tiny-ddtree"
API_KEY = "test-key"
PROMPTS = ["hello world", "the cat sat on", "12 + 7 ="]
MAX_NUM_SEQS = 2
MAX_WAITING = 2


def _ephemeral_port_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _free_port() -> int:
    """A port free now, and outside the ranges other processes get ports from unasked.

    A port the kernel hands out (bind to 0) is in its ephemeral range, which every outgoing connection and every
    bind to 0 draws from as well: Ray's own processes took such a port between our pick and the Serve proxy's
    bind (CI: "Failed to bind to address"). Ray's workers take 10002-19999 (its min/max_worker_port), so the pick
    is from 20000 up to the ephemeral range, checked free by binding it.
    """
    ephemeral_low, _ = _ephemeral_port_range()
    candidates = list(range(20000, ephemeral_low)) or list(range(10000, 10002))  # (a range reaching down to 20000:
    # Ray's worker ports start at 10002)
    random.shuffle(candidates)
    for port in candidates[:200]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port between 20000 and the ephemeral range")


def _config_app(yaml_path: Path) -> dict:
    """ray_config.yaml's application, checked against Serve's own config schema."""
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load(yaml_path.read_text())
    ServeDeploySchema.model_validate(config) if hasattr(
        ServeDeploySchema, "model_validate"
    ) else ServeDeploySchema.parse_obj(config)
    (app,) = config["applications"]
    return app


DEFAULT_MAX_TOKENS = 12  # of a chat request that gives none


def _tiny_overrides(checkpoints: dict) -> dict:
    return {
        "model": str(checkpoints["target"]),
        "drafter": str(checkpoints["drafter"]),
        "dtype": "float64",  # exact arithmetic: batching cannot flip a greedy token
        "served_model_name": MODEL_NAME,
        "api_key": API_KEY,
        "max_num_seqs": MAX_NUM_SEQS,
        "max_waiting": MAX_WAITING,
        "max_budget": 16,
        "worker_torch_threads": 1,  # tiny models: threads cost more than they give
        "default_max_tokens": DEFAULT_MAX_TOKENS,
        # a quarter of the 2-CPU test cluster per replica, so that a second app (another topology) fits beside it
        "engine_num_cpus": 0.25,
        "worker_num_cpus": 0.125,
    }


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_tiny")
    target = make_tiny_target(root / "target", logit_scale=8.0)
    return {"target": target, "drafter": make_tiny_drafter(root / "drafter", target)}


@pytest.fixture(scope="session")
def app_args(checkpoints) -> dict:
    app = _config_app(REPO / "ray_config.yaml")
    return {**app["args"], **_tiny_overrides(checkpoints)}


@pytest.fixture(scope="session")
def served(app_args):
    """The one Ray + Serve start of the session: the app of ray_config.yaml, through its import_path."""
    from ray import serve

    app_config = _config_app(REPO / "ray_config.yaml")
    module_name, attr = app_config["import_path"].split(":")
    build = getattr(importlib.import_module(module_name), attr)
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = _free_port()  # after Ray's start, whose processes take ports of their own
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build(app_args), name=APP_NAME, route_prefix=app_config["route_prefix"])
        yield {"base_url": f"http://127.0.0.1:{port}", "handle": serve.get_app_handle(APP_NAME)}
    finally:
        serve.shutdown()
        if started_ray:
            ray.shutdown()


@pytest.fixture(scope="session")
def client(served):
    return openai.OpenAI(base_url=served["base_url"] + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def offline(checkpoints, app_args):
    """The reference: the offline LLM on the same checkpoints and engine settings."""
    from ddtree import LLM

    return LLM(
        str(checkpoints["target"]),
        str(checkpoints["drafter"]),
        dtype="float64",
        speculation=app_args["speculation"],
        budget=app_args["budget"],
        max_budget=app_args["max_budget"],
        max_num_seqs=MAX_NUM_SEQS,
    )


def _engine_info(served) -> dict:
    from ray import serve

    return serve.get_app_handle(APP_NAME).info.remote().result()


def _post(served, path: str, body, key: str | None = API_KEY, **kw) -> requests.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return requests.post(served["base_url"] + path, json=body, headers=headers, timeout=60, **kw)


# ---- the config ------------------------------------------------------------------------------------------------


def test_cluster_guide_runtime_env_passes_serve_deploy_schema():
    """The `runtime_env` snippet of cluster/README.md, put into ray_config.yaml's application, is one `serve deploy`
    accepts (a local working_dir would not be)."""
    from ray.serve.schema import ServeDeploySchema

    guide = (REPO / "cluster" / "README.md").read_text()
    (snippet,) = [block for block in re.findall(r"```yaml\n(.*?)```", guide, re.S) if "runtime_env" in block]
    config = yaml.safe_load((REPO / "ray_config.yaml").read_text())
    config["applications"][0].update(yaml.safe_load(snippet.replace("<bucket>", "bucket")))
    ServeDeploySchema.model_validate(config)
    config["applications"][0]["runtime_env"]["working_dir"] = "."
    with pytest.raises(ValueError, match="remote URIs"):
        ServeDeploySchema.model_validate(config)


def test_ray_config_yaml_builds_the_app(app_args):
    from deployments.app import SERVER_DEPLOYMENT, build_app
    from deployments.config import parse_args

    app = _config_app(REPO / "ray_config.yaml")
    assert app["import_path"] == "deployments.app:build_app"
    assert parse_args(app["args"]).model is None  # the embedded default
    assert parse_args(app_args).model_name == MODEL_NAME
    # The overrides name deployments the builder really makes.
    assert parse_args(app["args"]).ingress == "engine"
    assert {d["name"] for d in app.get("deployments", [])} <= {SERVER_DEPLOYMENT}
    assert build_app(app["args"])._bound_deployment.name == SERVER_DEPLOYMENT
    with pytest.raises(ValueError):
        build_app({**app_args, "max_budgt": 8})
    assert parse_args(app["args"]).max_stream_chunks_per_s is None
    assert parse_args(app_args | {"max_stream_chunks_per_s": 40}).max_stream_chunks_per_s == 40
    for bad in (0, -1):
        with pytest.raises(ValueError, match="max_stream_chunks_per_s"):
            parse_args({**app_args, "max_stream_chunks_per_s": bad})


def test_replicas_drain_on_shutdown_and_a_dead_engine_is_replaced_soon(app_args):
    from deployments.app import ENGINE_DEPLOYMENT, INGRESS_DEPLOYMENT, SERVER_DEPLOYMENT, build_app

    server = build_app(app_args)._bound_deployment  # ingress "engine": one deployment
    assert server.name == SERVER_DEPLOYMENT
    ingress = build_app({**app_args, "ingress": "separate"})._bound_deployment
    engine = ingress.init_args[0]._bound_deployment
    assert (ingress.name, engine.name) == (INGRESS_DEPLOYMENT, ENGINE_DEPLOYMENT)
    for deployment in (server, ingress, engine):
        assert deployment._deployment_config.graceful_shutdown_timeout_s >= 600
    for deployment in (server, engine):
        assert deployment._deployment_config.health_check_period_s <= 2
    assert server._replica_config.placement_group_bundles == engine._replica_config.placement_group_bundles
    # ray_config.yaml's per-deployment overrides (applied by Serve on top) keep these
    overrides = {d["name"]: d for d in _config_app(REPO / "ray_config.yaml")["deployments"]}
    for key, value in overrides[SERVER_DEPLOYMENT].items():
        if key != "name":
            assert getattr(server._deployment_config, key) == value, key


# ---- OpenAI API through the official client ------------------------------------------------------------------


def test_models_and_health(served, client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-9")
    assert info.value.body["code"] == "model_not_found"
    assert requests.get(served["base_url"] + "/health", timeout=10).json() == {"status": "ok"}


def _thread_nice_values(pid: int) -> set[int]:
    values = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # (a thread that ended meanwhile)
            values.add(int(task.joinpath("stat").read_text().rsplit(")", 1)[1].split()[16]))  # field 19: nice
    return values


def test_the_replica_takes_the_apps_gil_switch_interval(served, app_args):
    """The replica's process switches threads at `gil_switch_interval_ms` (ray_config.yaml's value), not at Python's
    5 ms: the engine loop thread takes a worker's reply while the event loop thread streams."""
    assert app_args["gil_switch_interval_ms"] < 5
    assert _engine_info(served)["gil_switch_interval_s"] == pytest.approx(app_args["gil_switch_interval_ms"] / 1000)


def test_the_rounds_threads_run_at_the_apps_round_nice(served, client, app_args):
    """The replica's engine loop and both worker actors' compute threads take `round_nice` (ray_config.yaml's
    value); each process's other threads keep theirs."""
    if os.geteuid() != 0:
        pytest.skip("a nice value below the current one needs CAP_SYS_NICE")
    client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=4, temperature=0)  # (a round ran)
    info = _engine_info(served)
    nice = app_args["round_nice"]
    assert nice < 0
    for pid in (info["pid"], info["worker_pids"]["target"], info["worker_pids"]["drafter"]):
        values = _thread_nice_values(pid)
        assert nice in values and len(values) > 1, (pid, values)


def test_completions_equal_offline_llm_at_t0(client, offline):
    params = SamplingParams(temperature=0.0, max_tokens=24)
    expected = offline.generate(PROMPTS, params)
    for prompt, ref in zip(PROMPTS, expected):
        out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0)
        assert out.choices[0].text == ref.text
        assert out.choices[0].finish_reason == ref.finish_reason
        assert out.usage.completion_tokens == len(ref.token_ids)
        assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
        ddtree = out.usage.model_extra["ddtree"]
        assert ddtree["speculation"] == "ddtree"
        assert ddtree["num_speculative_rounds"] + ddtree["num_autoregressive_rounds"] >= 1
        assert len(ddtree["acceptance_lengths"]) == ddtree["num_speculative_rounds"]


def test_chat_equals_offline_llm_at_t0(served, client, offline):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why is the sky blue?"}]
    prompt_ids = offline.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    ref = offline.generate([list(prompt_ids)], SamplingParams(temperature=0.0, max_tokens=20))[0]
    before = _engine_info(served)["num_generated_tokens"]
    out = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=20, temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.text
    assert out.usage.completion_tokens == len(ref.token_ids)
    # the replica's running count of emitted tokens (info(), what benchmarks read between their snapshots)
    assert _engine_info(served)["num_generated_tokens"] - before == len(ref.token_ids)


def test_stop_is_honoured_and_sampling_runs(client, offline):
    ref = offline.generate("hello world", SamplingParams(temperature=0.0, max_tokens=24))[0]
    stop = ref.text[3:5]  # a stop string the greedy answer is known to contain
    out = client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=24, temperature=0, stop=[stop])
    assert out.choices[0].text == ref.text[: ref.text.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    # Sampling with every knob set; equal seeds do not give equal samples across requests under budget "auto"
    # (the engine draws per tree node and the trees differ with live timings), so only the run itself is checked.
    sampled = client.completions.create(
        model=MODEL_NAME, prompt="the cat", max_tokens=16, temperature=0.8, top_p=0.9, seed=7, extra_body={"top_k": 5}
    )
    assert sampled.choices[0].finish_reason in ("stop", "length") and sampled.usage.completion_tokens >= 1


def test_streaming_completion_with_usage(client):
    whole = client.completions.create(model=MODEL_NAME, prompt="the cat sat on", max_tokens=24, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt="the cat sat on",
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 1  # incremental
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.usage is None for c in text_chunks)
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.completion_tokens == whole.usage.completion_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert "mean_acceptance_length" in usage.model_extra["ddtree"]


def test_a_batch_of_prompts_gets_one_choice_per_prompt(client, offline):
    """`prompt` as a list of prompts (text or token ids): choice i answers prompt i, whole or streamed; usage sums."""
    batch = ["the cat sat on", "a", "hello world"]
    refs = offline.generate(batch, SamplingParams(temperature=0.0, max_tokens=12))
    ids_batch = [[5, 6, 7], [8, 9]]
    ids_out = client.completions.create(model=MODEL_NAME, prompt=ids_batch, max_tokens=6, temperature=0)
    assert [c.text for c in ids_out.choices] == [
        r.text for r in offline.generate(ids_batch, SamplingParams(temperature=0.0, max_tokens=6))
    ]
    out = client.completions.create(model=MODEL_NAME, prompt=batch, max_tokens=12, temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [r.text for r in refs]
    assert out.usage.completion_tokens == sum(len(r.token_ids) for r in refs)
    assert out.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in refs)
    ddtree = out.usage.model_extra["ddtree"]
    assert ddtree["num_speculative_rounds"] == len(ddtree["acceptance_lengths"])
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=batch,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts, finish = ["", "", ""], [None, None, None]
    for c in chunks[:-1]:
        (choice,) = c.choices
        texts[choice.index] += choice.text
        finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert texts == [r.text for r in refs] and finish == [r.finish_reason for r in refs]
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens
    # one prompt refused (a token id outside the vocabulary): the whole request is, before any byte is sent
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL_NAME, prompt=[[5, 6], [99999]], max_tokens=4, stream=stream)


def test_streaming_chat_with_usage(client):
    messages = [{"role": "user", "content": "hi"}]
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_logprobs_through_the_client_equal_offline_llm(client, offline):
    """Chat and completions, whole and streamed: the OpenAI shapes, carrying the engine's log-probabilities."""
    ref = offline.generate("the cat sat on", SamplingParams(temperature=0.0, max_tokens=12, logprobs=2))[0]
    out = client.completions.create(model=MODEL_NAME, prompt="the cat sat on", max_tokens=12, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert lp.tokens == [t.text for t in ref.logprobs]
    assert lp.token_logprobs == pytest.approx([t.logprob for t in ref.logprobs], abs=1e-4)
    assert [list(d) for d in lp.top_logprobs] == [[text for _, text, _ in t.top] for t in ref.logprobs]
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    chunks = list(
        client.completions.create(
            model=MODEL_NAME, prompt="the cat sat on", max_tokens=12, temperature=0, logprobs=2, stream=True
        )
    )
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == lp.tokens

    messages = [{"role": "user", "content": "hi"}]
    prompt_ids = offline.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    ref = offline.generate([list(prompt_ids)], SamplingParams(temperature=0.0, max_tokens=10, logprobs=3))[0]
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0, logprobs=True, top_logprobs=3
    )
    content = out.choices[0].logprobs.content
    assert [c.token for c in content] == [t.text for t in ref.logprobs]
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token for c in content)
    assert content[0].bytes == list(content[0].token.encode())
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0, logprobs=True, stream=True
        )
    )
    streamed = [
        c.token for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content
    ]
    assert streamed == [t.text for t in ref.logprobs]
    plain = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_streaming_without_usage_ends_with_done(served):
    r = _post(
        served, "/v1/completions", {"model": MODEL_NAME, "prompt": "a", "max_tokens": 8, "stream": True}, stream=True
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line for line in r.iter_lines(decode_unicode=True) if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    assert '"usage"' not in "".join(events)


# ---- errors ----------------------------------------------------------------------------------------------------


def test_errors_through_the_client(served, client):
    bad_key = openai.OpenAI(base_url=served["base_url"] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=4)
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=4, n=2)
    assert info.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "x" * 600}], max_tokens=4
        )
    assert info.value.body["code"] == "context_length_exceeded" and info.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as info:  # the error comes before the stream starts
        client.completions.create(model=MODEL_NAME, prompt="x" * 600, max_tokens=4, stream=True)
    assert info.value.body["code"] == "context_length_exceeded"


@pytest.mark.parametrize(
    "path, body, key, status",
    [
        ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi"}, None, 401),
        ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "temperature": -1}, API_KEY, 400),
        ("/v1/completions", {"model": MODEL_NAME, "prompt": [99999]}, API_KEY, 400),  # token id outside the vocab
        ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "best_of": 3}, API_KEY, 400),
        ("/v1/chat/completions", {"model": MODEL_NAME, "messages": "hi"}, API_KEY, 400),
        ("/v1/embeddings", {"model": MODEL_NAME, "input": "hi"}, API_KEY, 404),
        # a lone UTF-16 surrogate ("\ud800" in JSON) is not text a tokenizer can take
        ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi \ud800 there"}, API_KEY, 400),
        (
            "/v1/chat/completions",
            {"model": MODEL_NAME, "messages": [{"role": "user", "content": "a\udfff"}]},
            API_KEY,
            400,
        ),
        # OpenAI's types are strict: no true for 1, no "yes" for true, no "0.5" for 0.5
        ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": True}, API_KEY, 400),
        ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "stream": "yes"}, API_KEY, 400),
        (
            "/v1/chat/completions",
            {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "temperature": "0.5"},
            API_KEY,
            400,
        ),
    ],
)
def test_error_shape_and_status(served, path, body, key, status):
    r = _post(served, path, body, key=key)
    assert r.status_code == status
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    if status == 400:
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_invalid_json_is_a_400(served):
    for data in ("{nope", "[" * 100_000 + "]" * 100_000):  # not JSON; JSON nested past the parser's recursion
        r = requests.post(
            served["base_url"] + "/v1/completions",
            data=data,
            timeout=10,
            headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
        )
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_a_body_past_the_limit_is_a_413_before_it_is_read_whole(served):
    """A body larger than MAX_BODY_BYTES is refused in the OpenAI error shape: at once when its Content-Length
    says so, and when it comes chunked with no length, as soon as what arrived passes the limit."""
    from deployments.ingress import MAX_BODY_BYTES

    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    big = b'{"model": "' + MODEL_NAME.encode() + b'", "prompt": "' + b"a" * MAX_BODY_BYTES + b'"}'

    def chunked():
        for start in range(0, len(big), 1 << 20):
            yield big[start : start + (1 << 20)]

    for data in (big, chunked()):
        r = requests.post(served["base_url"] + "/v1/completions", data=data, headers=headers, timeout=60)
        assert r.status_code == 413, r.text[:300]
        assert r.json()["error"]["code"] == "request_too_large" and set(r.json()["error"]) == {
            "message",
            "type",
            "param",
            "code",
        }
    ok = requests.post(
        served["base_url"] + "/v1/completions",
        headers=headers,
        timeout=60,
        json={"model": MODEL_NAME, "prompt": "a" * 100, "max_tokens": 2},
    )
    assert ok.status_code == 200


def test_msgpack_bodies_and_answers(served):
    """The binary option: a msgpack request body gets the JSON request's answer; `Accept: application/msgpack`
    gets it (and errors) in msgpack; a stream stays server-sent events; a bad msgpack body is a 400."""
    import msgpack

    body = {"model": MODEL_NAME, "prompt": "hello world", "max_tokens": 6, "temperature": 0}
    auth = {"Authorization": f"Bearer {API_KEY}"}
    as_json = _post(served, "/v1/completions", body).json()

    def post(payload: bytes, **headers) -> requests.Response:
        return requests.post(
            served["base_url"] + "/v1/completions",
            data=payload,
            timeout=60,
            headers={**auth, "Content-Type": "application/msgpack", **headers},
        )

    r = post(msgpack.packb(body))
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["choices"][0]["text"] == as_json["choices"][0]["text"]
    r = post(msgpack.packb(body), Accept="application/msgpack")
    assert r.status_code == 200 and r.headers["content-type"] == "application/msgpack"
    answer = msgpack.unpackb(r.content)
    assert answer["choices"][0]["text"] == as_json["choices"][0]["text"] and answer["object"] == "text_completion"
    r = post(msgpack.packb({**body, "n": 2}), Accept="application/msgpack")
    assert r.status_code == 400 and msgpack.unpackb(r.content)["error"]["param"] == "n"
    r = post(msgpack.packb({**body, "stream": True}))
    assert r.headers["content-type"].startswith("text/event-stream") and r.text.rstrip().endswith("[DONE]")
    for bad in (b"\xc1", msgpack.packb(body) + b"x", b"\xd9\x02\xff\xfe"):  # reserved byte, trailing data, bad UTF-8
        r = post(bad)
        assert r.status_code == 400 and r.json()["error"]["message"] == "The request body is not valid msgpack."
    models = requests.get(
        served["base_url"] + "/v1/models", headers={**auth, "Accept": "application/msgpack"}, timeout=10
    )
    assert msgpack.unpackb(models.content)["data"][0]["id"] == MODEL_NAME
    refused = requests.get(
        served["base_url"] + "/v1/models",
        timeout=10,
        headers={**auth, "Accept": "application/msgpack;q=0, application/json"},
    )
    assert refused.json()["data"][0]["id"] == MODEL_NAME  # q=0 refuses msgpack
    r = post(msgpack.packb([1, 2]))
    assert r.status_code == 400 and "msgpack map" in r.json()["error"]["message"]


def test_max_tokens_past_the_context_window_is_refused_as_openai_does(served, client):
    """A client that asks for more tokens than the window leaves is told so (400), not cut short; a request that
    gives no max_tokens still gets the server's default."""
    window = _engine_info(served)["max_model_len"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=window)
    assert info.value.body["code"] == "context_length_exceeded" and str(window) in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=window
        )
    assert info.value.body["code"] == "context_length_exceeded"
    prompt = [5] * (window - 4)  # token ids: exactly window - 4 tokens
    out = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 4  # the window, exactly: accepted
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5)
    assert info.value.body["code"] == "context_length_exceeded"


def test_a_huge_prompt_is_refused_before_it_is_tokenized(served):
    """More characters than the window could hold tokens of the vocabulary's longest: refused at once, without
    tokenizing megabytes of text."""
    t0 = time.perf_counter()
    r = _post(served, "/v1/completions", {"model": MODEL_NAME, "prompt": "a b " * 500_000, "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "characters" in r.json()["error"]["message"]
    assert time.perf_counter() - t0 < 5


def test_full_queue_answers_429_and_disconnects_abort(served):
    # Sampled, so that neither drafts nor n-gram chains (a greedy tiny model soon repeats itself) finish 400 tokens
    # before all four requests are in.
    long_body = {
        "model": MODEL_NAME,
        "prompt": "the cat",
        "max_tokens": 400,
        "temperature": 1.0,
        "seed": 0,
        "ignore_eos": True,
        "stream": True,
    }
    streams = []
    lock = threading.Lock()

    def open_stream():
        r = _post(served, "/v1/completions", long_body, stream=True)
        with lock:
            streams.append(r)

    # MAX_NUM_SEQS decoding + MAX_WAITING queued; the waiting ones get no headers until admitted, hence threads.
    threads = [threading.Thread(target=open_stream) for _ in range(MAX_NUM_SEQS + MAX_WAITING)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    deadline = time.time() + 30
    while time.time() < deadline:
        info = _engine_info(served)
        if info["num_running"] == MAX_NUM_SEQS and info["num_waiting"] == MAX_WAITING:
            break
        time.sleep(0.05)
    assert (info["num_running"], info["num_waiting"]) == (MAX_NUM_SEQS, MAX_WAITING)
    r = _post(served, "/v1/completions", {**long_body, "stream": False})
    assert r.status_code == 429 and r.json()["error"]["code"] == "engine_queue_full"
    assert r.headers["Retry-After"] == "1"

    # Clients going away abort their requests: the engine empties long before 400 tokens each.
    while any(t.is_alive() for t in threads) or streams:
        with lock:
            while streams:
                streams.pop().close()
        time.sleep(0.05)
    deadline = time.time() + 20
    while time.time() < deadline and (info := _engine_info(served))["num_running"] + info["num_waiting"] > 0:
        time.sleep(0.1)
    assert info["num_running"] + info["num_waiting"] == 0
    r = _post(served, "/v1/completions", {"model": MODEL_NAME, "prompt": "a", "max_tokens": 4})
    assert r.status_code == 200


# ---- Python handle API -----------------------------------------------------------------------------------------


def test_handle_generate_and_stream_equal_offline_llm(served, offline):
    handle = served["handle"]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    ref = offline.generate("hello world", params)[0]
    final = handle.generate.remote("hello world", params).result()
    assert final.token_ids == ref.token_ids and final.text == ref.text and final.finished
    outputs = list(handle.options(stream=True).generate_stream.remote("hello world", params))
    assert len(outputs) > 1 and outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    assert "".join(o.new_text for o in outputs) == ref.text
    assert [t for o in outputs for t in o.new_token_ids] == ref.token_ids
    assert all(o.token_ids == [] and o.text == "" for o in outputs[:-1])  # increments only, until the last
    last = outputs[-1]  # everything, stats included (their budgets follow the served engine's own cost model)
    assert last.token_ids == ref.token_ids and last.text == ref.text
    assert last.stats.num_speculative_rounds + last.stats.num_autoregressive_rounds > 0
    token_ids = offline.tokenizer.encode("hello world", add_special_tokens=False)
    assert handle.generate.remote(token_ids, params).result().token_ids == ref.token_ids


def test_handle_errors_are_api_errors(served):
    from deployments.errors import APIError

    with pytest.raises(APIError) as info:
        served["handle"].generate.remote("x" * 600, SamplingParams(max_tokens=4)).result()
    assert info.value.status == 400 and info.value.code == "context_length_exceeded"
    with pytest.raises(APIError):
        served["handle"].generate.remote(None, SamplingParams()).result()  # neither prompt nor messages


def test_handle_example_runs(served):
    from deployments.handle_example import run_example

    final, streamed = run_example(APP_NAME, max_tokens=8)
    assert final.finished and 1 <= len(final.token_ids) <= 8
    assert streamed[-1].finished


def test_locustfile_load_test_runs_and_counts_each_request_once(served, tmp_path):
    """`loadtest/locustfile.py` headless for a few seconds: Locust's requests are the HTTP requests (the per-request
    metrics do not inflate its counts), the llmperf-style summary and its CSV are written."""
    import csv
    import json
    import subprocess
    import sys

    prefix, summary_path = tmp_path / "run", tmp_path / "summary.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "locust",
            "-f",
            str(REPO / "loadtest" / "locustfile.py"),
            "--host",
            served["base_url"],
            "--headless",
            "-u",
            "2",
            "-r",
            "2",
            "-t",
            "6s",
            "--csv",
            str(prefix),
            "--summary-json",
            str(summary_path),
            "--model",
            MODEL_NAME,
            "--api-key",
            API_KEY,
            "--max-tokens",
            "8",
            "--stop-timeout",
            "10",
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    summary = json.loads(summary_path.read_text())
    assert summary["num_completed_requests"] > 0 and summary["num_failed_requests"] == 0
    with open(f"{prefix}_stats.csv") as f:
        rows = {row["Name"]: row for row in csv.DictReader(f)}
    # Only the HTTP requests are Locust requests (its final CSV write may miss the last second's few)
    assert set(rows) == {"/v1/chat/completions (stream)", "Aggregated"}
    assert 0 < int(rows["Aggregated"]["Request Count"]) <= summary["num_completed_requests"]
    with open(f"{prefix}_llm.csv") as f:
        llm = {row["metric"]: row for row in csv.DictReader(f)}
    assert {"ttft_ms", "itl_ms", "tpot_ms", "e2e_latency_ms", "output_tokens_per_s", "output_tokens"} <= set(llm)
    assert 1 <= float(llm["output_tokens"]["max"]) <= 8
    spec = summary["speculation"]  # the server reports usage.ddtree: how the tokens were made
    assert spec["num_requests"] == summary["num_completed_requests"]
    assert spec["speculative_rounds"] + spec["autoregressive_rounds"] > 0
    assert spec["output_tokens_per_round"] >= 1.0


def test_locustfile_distributed_run_summarises_every_worker(served, tmp_path):
    """With `--processes 2` the workers' metrics reach the master, which alone writes the summary: it counts the
    requests Locust counted (the master's own Summary runs no users)."""
    import csv
    import json
    import subprocess
    import sys

    prefix, summary_path = tmp_path / "sub" / "run", tmp_path / "sub" / "summary.json"  # folders made as needed
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "locust",
            "-f",
            str(REPO / "loadtest" / "locustfile.py"),
            "--host",
            served["base_url"],
            "--headless",
            "-u",
            "2",
            "-r",
            "2",
            "-t",
            "6s",
            "--processes",
            "2",
            "--csv",
            str(prefix),
            "--summary-json",
            str(summary_path),
            "--model",
            MODEL_NAME,
            "--api-key",
            API_KEY,
            "--max-tokens",
            "8",
            "--stop-timeout",
            "10",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads(summary_path.read_text())
    with open(f"{prefix}_stats.csv") as f:
        rows = {row["Name"]: row for row in csv.DictReader(f)}
    locust_count = int(rows["Aggregated"]["Request Count"])
    assert summary["num_failed_requests"] == 0
    assert 0 < locust_count <= summary["num_completed_requests"] <= locust_count + 4  # the last report's few
    with open(f"{prefix}_llm.csv") as f:
        llm = {row["metric"]: row for row in csv.DictReader(f)}
    assert int(float(llm["output_tokens"]["count"])) == summary["num_completed_requests"]


def test_engine_reports_timings_and_metrics_without_errors(served):
    info = _engine_info(served)
    assert info["timings"]["num_rounds"] > 0
    assert info["actor_hop_calls"] > 0 and info["actor_hop_seconds"] > 0
    assert info["num_metrics_errors"] == 0


# ---- two request groups in flight on the worker actors ----------------------------------------------------------


ACTOR_PROMPTS = ["hello world", "the cat sat on", "12 + 7 =", "why is the sky blue?", "a"]


def _engine_on_actors(actors, pipeline: bool):
    """An engine (ddtree, budget 8, 4 seats, a fixed cost model) on the worker actors' proxies."""
    from ddtree.cost import CostModel
    from ddtree.engine import Engine, EngineConfig

    config = EngineConfig(speculation="ddtree", budget=8, max_budget=16, max_num_seqs=4, pipeline=pipeline)
    cost = CostModel([(1, 0.010), (64, 0.012), (1024, 0.05)], [(1, 0.002), (16, 0.003)])
    return Engine(config, actors.target_proxy, actors.drafter_proxy, actors.target_proxy.tokenizer, cost=cost)


def _offline_off(checkpoints, params) -> list[list[int]]:
    """ACTOR_PROMPTS' token ids from the offline engine with speculation off (float64, as the actors load)."""
    from ddtree import LLM

    llm = LLM(str(checkpoints["target"]), str(checkpoints["drafter"]), dtype="float64", speculation="off")
    return [o.token_ids for o in llm.generate(ACTOR_PROMPTS, params)]


def test_pipelined_engine_on_worker_actors_equals_offline_off(served, app_args, checkpoints):
    """pipeline=True through the actor proxies (draft_async / verify_async as calls in flight on the two workers'
    channels, features sent target -> drafter): T=0 outputs equal the offline engine with speculation off."""
    from ddtree import LLM, SamplingParams
    from deployments.actors import start_worker_actors
    from deployments.config import ActorPlace, WorkerSpec, parse_args

    args = parse_args({**app_args, "pipeline": True})
    assert args.pipeline is True
    place_target, place_drafter = ActorPlace(0, 0.0, 0.0), ActorPlace(0, 0.0, 0.0)  # the app holds the CPUs
    actors = start_worker_actors(WorkerSpec.from_args(args), place_target, place_drafter)
    try:
        engine = _engine_on_actors(actors, pipeline=True)
        params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        outputs = LLM.from_engine(engine).generate(ACTOR_PROMPTS, params)
        assert [o.token_ids for o in outputs] == _offline_off(checkpoints, params)
        assert engine.timings.num_draft_calls > 0 and actors.hops.num_calls > engine.timings.num_draft_calls
        # Each worker's OpenMP threads spin briefly between a forward's parallel regions before they sleep
        # (deployments/config.py: WORKER_OPENMP_ENV), whatever the replica's own waits; one thread by default, the
        # channel thread taking the spec's count (tests/test_worker_threads.py); its memory on 2 MB pages
        for pid in (actors.target_proxy.pid, actors.drafter_proxy.pid):
            environ = dict(
                item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item
            )
            assert environ["GOMP_SPINCOUNT"] == "30000" and environ["OMP_NUM_THREADS"] == "1"
            assert environ["THP_MEM_ALLOC_ENABLE"] == "1"
    finally:
        actors.kill()


def test_prompts_joining_the_verify_pass_on_worker_actors_equal_offline_off(served, app_args, checkpoints):
    """Requests arriving while others run, through the actor proxies: their prompts go into the round's verify pass
    (one call), and T=0 outputs equal the offline engine with speculation off."""
    from ddtree import SamplingParams
    from deployments.actors import start_worker_actors
    from deployments.config import ActorPlace, WorkerSpec, parse_args

    place = ActorPlace(0, 0.0, 0.0)  # the app holds the CPUs
    actors = start_worker_actors(WorkerSpec.from_args(parse_args(app_args)), place, place)
    try:
        engine = _engine_on_actors(actors, pipeline=False)
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        ids, finals, pending = {}, {}, list(ACTOR_PROMPTS)
        while pending or engine.has_unfinished_requests():
            if pending:
                prompt = pending.pop(0)
                ids[engine.add_request(prompt, params)] = prompt
            finals.update({ids[o.request_id]: o.token_ids for o in engine.step() if o.finished})
        assert [finals[p] for p in ACTOR_PROMPTS] == _offline_off(checkpoints, params)
        n = len(ACTOR_PROMPTS)
        assert engine.timings.num_prefill_calls == 1 and engine.timings.num_prompts_in_verify == n - 1
        assert engine.timings.num_draft_calls > 0
    finally:
        actors.kill()


def test_features_reach_the_drafter_through_fallback_and_back(served, app_args):
    """On the worker actors, a prompt's features wait in the target actor until the request drafts; a drafting
    request's features go from the target to the drafter after its verify; a request decoding without a draft
    (fallback) leaves its features in the target actor and gets them all when it drafts again: the drafter's
    context always holds every token the target has run for it, once. A request that never drafted is freed
    without a drafter call. A prompt taken in by a verify pass waits in the target actor as a prefilled one does."""
    from ddtree.contracts import Drafter, Target
    from deployments.actors import start_worker_actors
    from deployments.config import ActorPlace, WorkerSpec, parse_args

    place = ActorPlace(0, 0.0, 0.0)  # the app holds the CPUs
    actors = start_worker_actors(WorkerSpec.from_args(parse_args(app_args)), place, place)
    target, drafter = actors.target_proxy, actors.drafter_proxy
    assert isinstance(target, Target) and isinstance(drafter, Drafter)  # the engine's contract (ddtree/contracts.py)
    try:
        prompts = {"a": [5, 6, 7, 8], "b": [9, 10, 11], "c": [12, 13]}
        params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        for rid in [*prompts, "d"]:
            assert target.allocate(rid, 64, params)
        roots = dict(zip(prompts, target.prefill(list(prompts), list(prompts.values())).token_ids))
        prompt_d = [14, 15, 16]
        num_run = {rid: len(p) for rid, p in prompts.items()}  # tokens the target has run (features made)

        def context_len(rid: str) -> int:
            return ray.get(actors.drafter.context_len.remote(rid))

        def waiting_in_target(rid: str) -> int:
            return ray.get(actors.target.num_new_features.remote(rid))

        assert [waiting_in_target(r) for r in prompts] == [len(p) for p in prompts.values()]
        calls = actors.hops.num_calls
        target.free("c")
        drafter.free("c")  # c never drafted: the drafter never heard of it
        assert actors.hops.num_calls == calls + 1  # the target's Free only
        del prompts["c"]

        for round_index in range(5):
            drafting = ["a", "b"] if round_index in (0, 4) else ["a"]  # b rests in fallback for rounds 1-3
            drafter.draft(drafting, [roots[r] for r in drafting], target.take_features(drafting), 4)
            assert [context_len(r) for r in drafting] == [num_run[r] for r in drafting]
            joining = (["d"], [prompt_d]) if round_index == 0 else ()
            result = target.verify(["a", "b"], [None, None], [roots["a"], roots["b"]], *joining)  # 1 token each
            if joining:
                roots["d"] = result.prefilled.token_ids[0]
                assert waiting_in_target("d") == len(prompt_d)
            for i, rid in enumerate(["a", "b"]):
                num_run[rid] += 1 + len(result.accepted_token_ids[i])
                roots[rid] = result.bonus_token_ids[i]
            assert waiting_in_target("a") == 0  # a drafted: its features went on to the drafter
            if 1 <= round_index <= 3:  # b's features of the rounds it rests wait in the target actor
                assert waiting_in_target("b") == round_index
        assert waiting_in_target("b") == 0  # b drafted in round 4: sent with that verify
        assert context_len("b") == num_run["b"] - 1  # (the last verify's token not taken in yet)
        drafter.draft(["d"], [roots["d"]], target.take_features(["d"]), 4)
        assert context_len("d") == len(prompt_d) and waiting_in_target("d") == 0
    finally:
        actors.kill()


def test_a_separate_ingress_serves_the_same_answers(served, app_args, offline):
    """ingress "separate": an OpenAIIngress deployment in front of DDTreeEngine replicas, the same API and the same
    T=0 answers as the one-deployment default; stream chunks merged by stream_interval_ms carry the same text."""
    from ray import serve

    from deployments.app import build_app

    name = "ddtree-separate"
    serve.run(
        build_app({**app_args, "ingress": "separate", "stream_interval_ms": 200}), name=name, route_prefix="/separate"
    )
    try:
        client = openai.OpenAI(base_url=served["base_url"] + "/separate/v1", api_key=API_KEY, max_retries=0, timeout=60)
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        expected = offline.chat([{"role": "user", "content": "hello there"}], params)[0]
        out = client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "hello there"}],
            temperature=0,
            max_tokens=16,
            extra_body={"ignore_eos": True},
        )
        assert out.choices[0].message.content == expected.text
        chunks = [
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(
                model=MODEL_NAME,
                messages=[{"role": "user", "content": "hello there"}],
                temperature=0,
                max_tokens=16,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            if c.choices
        ]
        assert "".join(chunks) == expected.text
        assert serve.get_app_handle(name).info.remote().result()["num_running"] == 0
    finally:
        serve.delete(name)


def test_chat_without_max_tokens_gets_the_servers_default(client):
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == DEFAULT_MAX_TOKENS and out.choices[0].finish_reason == "length"


def test_a_dead_worker_actor_is_found_by_the_health_check(served, app_args):
    """Both actors answer the health check's ping; once one dies (killed, or its process crashed) the ping fails
    at once and names it, even while no request is running."""
    import asyncio

    from deployments.actors import start_worker_actors
    from deployments.config import ActorPlace, WorkerSpec, parse_args

    place = ActorPlace(0, 0.0, 0.0)  # the app holds the CPUs
    actors = start_worker_actors(WorkerSpec.from_args(parse_args(app_args)), place, place)
    try:
        assert asyncio.run(actors.find_dead()) is None
        ray.kill(actors.drafter)
        # ray.kill returns before the actor is gone: until then a ping times out or finds it unavailable, which
        # the health check does not call dead; it runs every few seconds, so it names the actor at a later check
        deadline, found = time.monotonic() + 30, None
        while found is None and time.monotonic() < deadline:
            found = asyncio.run(actors.find_dead())
        assert found is not None and found.startswith("the drafter actor died")
    finally:
        actors.kill()


def test_a_dead_worker_fails_its_call_at_once(served, app_args):
    """A worker actor that dies closes its channel: the engine's call in flight, or its next one, raises at once
    (the engine then decodes on without drafts, or waits for a new target) instead of waiting for an answer."""
    from deployments.actors import start_worker_actors
    from deployments.channel import ChannelClosedError
    from deployments.config import ActorPlace, WorkerSpec, parse_args

    place = ActorPlace(0, 0.0, 0.0)  # the app holds the CPUs
    actors = start_worker_actors(WorkerSpec.from_args(parse_args(app_args)), place, place)
    target, drafter = actors.target_proxy, actors.drafter_proxy
    try:
        params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        assert target.allocate("a", 64, params)
        (root,) = target.prefill(["a"], [[5, 6, 7]]).token_ids
        target.take_features(["a"])
        drafter.draft(["a"], [root], None, 4)
        ray.kill(actors.target)
        t0 = time.monotonic()
        with pytest.raises(ChannelClosedError, match="target"):
            for _ in range(50):  # (the kill is asynchronous: a call may still be answered just before)
                target.verify(["a"], [None], [root])
                time.sleep(0.1)
        ray.kill(actors.drafter)
        with pytest.raises(ChannelClosedError, match="drafter"):
            for _ in range(50):
                drafter.draft(["a"], [root], None, 4)
                time.sleep(0.1)
        assert time.monotonic() - t0 < 20
    finally:
        actors.kill()


@pytest.fixture(scope="module")
def fault_app(served, app_args):
    """An app whose worker actors the fault tests kill, with its handle and a client. A fixed budget: every request
    drafts while a drafter is there (auto's policy may decode a random tiny model's requests plain, which would
    leave "speculation resumed" unobservable)."""
    from ray import serve

    from deployments.app import build_app

    name, prefix = "ddtree-faults", "/faults"
    serve.run(build_app({**app_args, "budget": 4}), name=name, route_prefix=prefix)
    client = openai.OpenAI(base_url=served["base_url"] + prefix + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    try:
        yield serve.get_app_handle(name), client
    finally:
        serve.delete(name)


FAULT_MESSAGES = [[{"role": "user", "content": p}] for p in ["hello world", "the cat sat on", "12 + 7 =", "abc"]]


def _streams_through_a_kill(client, worker: str, handle, samplings: list[dict]) -> tuple[dict, int]:
    """Stream every FAULT_MESSAGES request (200 tokens each; `samplings`: each one's temperature and seed) and
    SIGKILL the `worker` actor's process once MAX_NUM_SEQS of them stream (the others wait for their seats):
    (each request's streamed text, how many had finished at the kill). Raises the first request that failed."""
    import os
    import signal

    pid = handle.info.remote().result()["worker_pids"][worker]
    texts: dict[int, str] = {}
    errors: list[BaseException] = []
    streaming = [threading.Event() for _ in FAULT_MESSAGES]  # set at a request's first chunk (once admitted)

    def stream(i: int) -> None:
        parts = []
        try:
            for chunk in client.chat.completions.create(
                model=MODEL_NAME,
                messages=FAULT_MESSAGES[i],
                max_tokens=200,
                stream=True,
                **samplings[i],
                extra_body={"ignore_eos": True},
            ):
                streaming[i].set()
                parts.extend(c.delta.content or "" for c in chunk.choices)
            texts[i] = "".join(parts)
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(FAULT_MESSAGES))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60  # the first requests stream, the others wait for their seats: kill now
    while sum(e.is_set() for e in streaming) < MAX_NUM_SEQS and time.monotonic() < deadline:
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)
    num_done_at_kill = len(texts)
    for t in threads:
        t.join(180)
    if errors:
        raise errors[0]
    return texts, num_done_at_kill


def _wait_for_info(handle, ready, seconds: float = 90) -> dict:
    deadline = time.monotonic() + seconds
    while True:
        info = handle.info.remote().result()
        if ready(info) or time.monotonic() > deadline:
            return info
        time.sleep(0.5)


def _assert_a_new_request_speculates(handle, client, info: dict, expected: str) -> None:
    """The first fault message, sent after the fault, gets `expected` and drafts (`info`: read before it)."""
    rounds = info["timings"]["num_speculative_request_rounds"]
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=FAULT_MESSAGES[0], temperature=0, max_tokens=200, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].message.content == expected
    assert handle.info.remote().result()["timings"]["num_speculative_request_rounds"] > rounds


def test_a_drafter_actor_killed_mid_stream_loses_no_request_and_comes_back(fault_app, offline):
    """The drafter actor's process is killed (SIGKILL) while streams run and others wait: every request finishes
    with the offline answer, none fails; the health check starts a new drafter actor, and requests admitted after
    it drafts again speculate."""
    handle, client = fault_app
    pid = handle.info.remote().result()["worker_pids"]["drafter"]
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    expected = [o.text for o in offline.chat(FAULT_MESSAGES, params)]
    before = handle.info.remote().result()
    texts, num_done_at_kill = _streams_through_a_kill(client, "drafter", handle, [{"temperature": 0}] * 4)
    assert num_done_at_kill < len(FAULT_MESSAGES)
    assert [texts[i] for i in range(len(FAULT_MESSAGES))] == expected
    info = _wait_for_info(
        handle, lambda i: i["num_drafter_restarts"] > before["num_drafter_restarts"] and i["drafter_lost"] is None
    )
    assert info["num_drafter_losses"] == before["num_drafter_losses"] + 1
    assert info["num_drafter_restarts"] == before["num_drafter_restarts"] + 1 and info["drafter_lost"] is None
    assert info["worker_pids"]["drafter"] not in (None, pid)
    _assert_a_new_request_speculates(handle, client, info, expected[0])


def test_a_target_actor_killed_mid_stream_loses_no_request_and_no_token(fault_app, offline):
    """The target actor's process is killed (SIGKILL) while streams run and others wait: the health check starts a
    new target actor (and drafter actor), every running request is prefilled again from its prompt and committed
    tokens, and every stream ends with the offline answer: no request fails, no token is repeated or missing, and
    seeded sampled requests give the text they give without the fault. Speculation goes on with the new pair."""
    handle, client = fault_app
    samplings = [
        {"temperature": 0},
        {"temperature": 0.9, "seed": 11},
        {"temperature": 0},
        {"temperature": 0.7, "seed": 5},
    ]
    params = [
        SamplingParams(temperature=s["temperature"], seed=s.get("seed"), max_tokens=200, ignore_eos=True)
        for s in samplings
    ]
    expected = [o.text for o in offline.chat(FAULT_MESSAGES, params)]
    before = handle.info.remote().result()
    texts, num_done_at_kill = _streams_through_a_kill(client, "target", handle, samplings)
    assert num_done_at_kill < len(FAULT_MESSAGES)
    assert [texts[i] for i in range(len(FAULT_MESSAGES))] == expected
    info = _wait_for_info(handle, lambda i: i["num_target_restarts"] > before["num_target_restarts"])
    assert info["num_target_losses"] == before["num_target_losses"] + 1 and info["target_lost"] is None
    assert info["num_target_restarts"] == before["num_target_restarts"] + 1
    assert info["worker_pids"]["target"] != before["worker_pids"]["target"]
    assert info["worker_pids"]["drafter"] != before["worker_pids"]["drafter"]
    assert info["kv_cache_bytes_used"] == 0 and info["num_drafter_contexts"] == 0
    _assert_a_new_request_speculates(handle, client, info, expected[0])


def test_a_replica_killed_mid_stream_fails_only_its_requests_and_is_replaced(fault_app, offline):
    """The engine replica's process is killed (SIGKILL) while its streams run and others wait: each of them ends
    with an error (none hangs, none ends as if complete), Serve starts a new replica with new workers, and the
    next request gets the offline answer."""
    import os
    import signal

    handle, client = fault_app
    before = handle.info.remote().result()
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    expected = [o.text for o in offline.chat(FAULT_MESSAGES, params)]
    ends: dict[int, str] = {}  # how each stream ended: "error" or its finish reason
    streaming = [threading.Event() for _ in FAULT_MESSAGES]

    def stream(i: int) -> None:
        reason = None
        try:
            for chunk in client.chat.completions.create(
                model=MODEL_NAME,
                messages=FAULT_MESSAGES[i],
                temperature=0,
                max_tokens=200,
                stream=True,
                extra_body={"ignore_eos": True},
            ):
                streaming[i].set()
                if chunk.choices and chunk.choices[0].finish_reason:
                    reason = chunk.choices[0].finish_reason
            ends[i] = reason or "ended without a finish reason"
        except Exception as exc:  # noqa: BLE001 - the client's error for a broken stream (its type varies)
            ends[i] = f"error: {type(exc).__name__}: {exc}"

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(FAULT_MESSAGES))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while sum(e.is_set() for e in streaming) < MAX_NUM_SEQS and time.monotonic() < deadline:
        time.sleep(0.005)
    os.kill(before["pid"], signal.SIGKILL)
    t0 = time.monotonic()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads) and time.monotonic() - t0 < 60
    assert len(ends) == len(FAULT_MESSAGES) and all(e.startswith("error") for e in ends.values()), ends
    deadline, out = time.monotonic() + 180, None
    while out is None and time.monotonic() < deadline:  # (Serve notices the death, then loads a new replica)
        try:
            out = client.chat.completions.create(
                model=MODEL_NAME,
                messages=FAULT_MESSAGES[0],
                temperature=0,
                max_tokens=200,
                extra_body={"ignore_eos": True},
            )
        except openai.APIError:
            time.sleep(1)
    assert out is not None and out.choices[0].message.content == expected[0]
    after = handle.info.remote().result()
    assert after["pid"] != before["pid"]
    assert set(after["worker_pids"].values()).isdisjoint(before["worker_pids"].values())


FUZZ_EXAMPLES = int(os.environ.get("DDTREE_FUZZ_EXAMPLES", "50"))  # per operation that takes a request body


def test_schemathesis_finds_no_server_error_and_every_4xx_has_the_openai_shape(served):
    """schemathesis generates requests from the app's own OpenAPI document (request bodies from the protocol's
    models, the served model's name included, so that many cases are valid and run on the engine): no answer is a
    5xx, and every 4xx has OpenAI's error shape. DDTREE_FUZZ_EXAMPLES=500 runs 1000+ cases (docs/serving.md)."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_url(served["base_url"] + "/openapi.json")
    headers = {"Authorization": f"Bearer {API_KEY}"}
    statuses: dict[int, int] = {}
    cases: dict[str, int] = {}
    for result in schema.get_all_operations():
        operation = result.ok()

        @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def run(case) -> None:
            response = case.call(base_url=served["base_url"], headers=headers, timeout=60)
            cases[case.path] = cases.get(case.path, 0) + 1
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            where = f"{case.method} {case.formatted_path} {case.body!r:.300}"
            assert response.status_code < 500, f"{where}: {response.status_code} {response.text[:300]}"
            if response.status_code >= 400:
                error = response.json()["error"]
                if os.environ.get("DDTREE_FUZZ_DEBUG"):
                    print(case.path, response.status_code, error["message"][:120])
                assert set(error) == {"message", "type", "param", "code"}, where
                assert isinstance(error["message"], str) and error["message"], where

        run()
    print(f"schemathesis cases per path: {cases}; statuses: {dict(sorted(statuses.items()))}")
    assert cases["/v1/completions"] >= FUZZ_EXAMPLES * 0.9 and cases["/v1/chat/completions"] >= FUZZ_EXAMPLES * 0.9
    assert statuses.get(200, 0) > 0 and sum(n for s, n in statuses.items() if 400 <= s < 500) > 0


STORM_CYCLES = int(os.environ.get("DDTREE_STORM_CYCLES", "50"))


def test_a_storm_of_disconnected_streams_leaves_nothing_behind(served):
    """Cycles of: start a stream, read a chunk or two, disconnect. Afterwards nothing runs or waits, the KV cache
    and the drafter hold nothing, and the replica's threads and asyncio tasks are back to their count before.
    DDTREE_STORM_CYCLES=1000 runs the long version (docs/serving.md)."""
    import http.client
    import json as json_module
    from urllib.parse import urlparse

    url = urlparse(served["base_url"])
    body = json_module.dumps(
        {
            "model": MODEL_NAME,
            "prompt": "the cat sat on the mat",
            "max_tokens": 200,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
    )
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}

    def settled(deadline_s: float = 60) -> dict:
        deadline = time.monotonic() + deadline_s
        while True:
            info = _engine_info(served)
            if (info["num_running"], info["num_waiting"], info["kv_cache_bytes_used"]) == (
                0,
                0,
                0,
            ) or time.monotonic() > deadline:
                return info
            time.sleep(0.1)

    def cycle(num_chunks: int) -> None:
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
        conn.request("POST", "/v1/completions", body=body, headers=headers)
        response = conn.getresponse()
        assert response.status == 200
        for _ in range(num_chunks):
            response.fp.readline()
        conn.sock.shutdown(socket.SHUT_RDWR)  # the client goes away mid-stream
        conn.close()

    cycle(2)
    before = settled()
    t0 = time.monotonic()
    for i in range(STORM_CYCLES):
        cycle(1 + i % 3)
    after = settled()
    print(
        f"{STORM_CYCLES} cycles in {time.monotonic() - t0:.0f} s; before: {before['num_threads']} threads, "
        f"{before['num_asyncio_tasks']} tasks; after: {after['num_threads']}, {after['num_asyncio_tasks']}"
    )
    assert (after["num_running"], after["num_waiting"], after["kv_cache_bytes_used"]) == (0, 0, 0)
    assert after["num_drafter_contexts"] == 0
    assert after["num_threads"] <= before["num_threads"] + 2, (before["num_threads"], after["num_threads"])
    assert after["num_asyncio_tasks"] <= before["num_asyncio_tasks"] + 2, (
        before["num_asyncio_tasks"],
        after["num_asyncio_tasks"],
    )
    ok = _post(served, "/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4})
    assert ok.status_code == 200
