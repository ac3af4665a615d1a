"""The application's arguments (`build_app(args)`, the `args:` of ray_config.yaml), validated before anything is built.

Placement of one engine replica (Ray placement group bundles; bundle 0 holds the replica itself):

    cpu             [engine CPUs] [target+drafter CPUs]                 both actors share the bundle's cores
    gpu-per-worker  [engine CPUs] [target CPUs + 1 GPU] [drafter CPUs + 1 GPU]   STRICT_PACK: one node
    shared-gpu      [engine CPUs] [target+drafter CPUs + 1 GPU]        both actors on one GPU (half each)

Every placement is STRICT_PACK: a replica talks to its workers over Unix sockets (deployments/channel.py), and the
features that go from target to drafter every round stay on the node. With speculation "off" there is no drafter actor
and no drafter bundle (on `cpu`, the target takes the whole bundle: the replica holds the same CPUs in every mode).

Threads follow the placement. On `cpu` the drafter and the target run one after the other (each round drafts, then
verifies), so each uses every core the replica holds (engine + workers, e.g. 0.5 + 2 x 0.75 = 2), and idle OpenMP
threads wait passively; two request groups are kept in flight (`pipeline`) only where the workers have cores or
devices of their own (`gpu-per-worker`). On GPUs each worker's CPU threads are its own bundle's CPUs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, SecretStr, field_validator, model_validator

from ddtree.config import SERVE_DEFAULTS, EngineConfig

# The engine's settings take their defaults from EngineConfig (and SERVE_DEFAULTS): one source for both APIs.
_ENGINE = EngineConfig(**SERVE_DEFAULTS)

# How idle OpenMP threads wait. Not long: the target and the drafter take turns on the same cores, and a pool
# spinning in one actor steals them from the other. Not asleep at once either: a forward runs hundreds of parallel
# regions, and a futex wake-up at each costs the verify (docs/serving.md, "Threads", has both costs). So a worker
# spins GOMP_SPINCOUNT iterations (~0.3 ms, longer than the gaps between a forward's regions) before it sleeps; the
# replica, whose torch ops are few and small, sleeps at once (a spin count of 0). Both must be set before torch loads
# OpenMP, so they go in the processes' environments, and both set the same variables: Ray's workers inherit its
# driver's environment, and a worker actor the replica's (KMP_*: Intel's OpenMP, where torch uses it).
WORKER_OPENMP_ENV = {"GOMP_SPINCOUNT": "30000", "KMP_BLOCKTIME": "1"}
REPLICA_OPENMP_ENV = {"GOMP_SPINCOUNT": "0", "KMP_BLOCKTIME": "0"}

# The workers' weights and KV cache on 2 MB pages: with THP_MEM_ALLOC_ENABLE set, PyTorch's CPU allocator aligns every
# allocation of 2 MB or more to 2 MB and asks the kernel for transparent huge pages (madvise; the kernel's
# /sys/kernel/mm/transparent_hugepage/enabled must not be `never`). A decode step streams every weight: on 4 KB pages
# the embedded target's ~540 MB cross ~130,000 pages per forward, and each new page can miss the TLB; on 2 MB pages,
# ~270. Read at torch's first allocation, so it goes in the process's environment. `worker_env` overrides it.
WORKER_MEMORY_ENV = {"THP_MEM_ALLOC_ENABLE": "1"}


def use_worker_env() -> None:
    """This process's OpenMP threads wait, and its allocations use pages, as the worker actors' do (values already in
    the environment win): for a benchmark's in-process engine, compared with engines on worker actors. Call before
    torch is imported."""
    defaults = {**WORKER_OPENMP_ENV, **WORKER_MEMORY_ENV}
    os.environ.update({key: os.environ.get(key, value) for key, value in defaults.items()})


PLACEMENTS = ("cpu", "gpu-per-worker", "shared-gpu")
DEFAULT_SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"


class AppArgs(BaseModel):
    """Everything `build_app` accepts. Unknown keys are an error (a typo must not be silently ignored)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(
        None,
        description="Target model: a local folder (config.json + safetensors), a .gguf file, or a hub id. "
        "None: the embedded SmolLM2-135M-Instruct.",
    )
    drafter: str | None = Field(
        None, description="DFlash drafter checkpoint folder. None: the shipped drafter of the embedded target."
    )
    served_model_name: str | None = Field(
        None, description="The `model` name clients send and /v1/models lists. None: derived from `model`."
    )
    device: str | None = Field(
        None,
        description="Torch device of the workers: 'cpu' or 'cuda'. None: 'cpu' for placement 'cpu', "
        "'cuda' otherwise (each actor sees only the GPU Ray gave it).",
    )
    dtype: str | None = Field(
        None,
        description="Weights dtype (float32, bfloat16, float16, float64). None: float32 on CPU, bfloat16 on "
        "CUDA. bfloat16 on a CPU with bf16 dot products: bf16 weights, float32 activations and KV.",
    )
    speculation: Literal["ddtree", "dflash", "off"] = Field(
        _ENGINE.speculation,
        description="'ddtree': draft trees; 'dflash': the drafter's argmax chain; 'off': autoregressive.",
    )
    budget: Literal["auto"] | PositiveInt = Field(
        _ENGINE.budget,
        description="Draft tree nodes per speculative request: 'auto' (adaptive per round) or a fixed count.",
    )
    max_budget: PositiveInt = Field(_ENGINE.max_budget, description="Cap on nodes per request in 'auto' mode.")
    max_num_seqs: PositiveInt = Field(
        _ENGINE.max_num_seqs, description="Requests decoded together by one engine replica."
    )
    max_waiting: PositiveInt = Field(
        _ENGINE.max_waiting,
        description="Requests queued per engine replica beyond its free seats (max_num_seqs); beyond it the "
        "API answers 429.",
    )
    max_queue_seconds: float | None = Field(
        _ENGINE.max_queue_seconds,
        gt=0,
        description="A request still waiting for admission after this long is answered 503 "
        "(queue_timeout, with Retry-After) instead of waiting on. None: requests wait as long as it takes.",
    )
    max_model_len: int | None = Field(
        _ENGINE.max_model_len, ge=2, description="Context window cap. None: the model's own."
    )
    default_max_tokens: PositiveInt | None = Field(
        None,
        description="max_tokens of a chat request that gives none. None: the rest of the context window "
        "(OpenAI's behaviour); each request reserves its prompt + max_tokens in the KV cache when admitted, so a "
        "cap lets more such requests decode at once.",
    )
    kv_cache_bytes: PositiveInt | None = Field(
        None,
        description="KV cache memory of the target worker, counting with each token's KV entries the target "
        "features it keeps until the drafter takes them. None: 1 GiB on a CPU; on a GPU half the memory free once the "
        "target's weights are loaded.",
    )
    attention: Literal["auto", "sdpa", "flex"] = Field(
        "auto", description="Attention backend of the workers ('auto', 'sdpa', 'flex')."
    )
    allow_fallback: bool = Field(
        _ENGINE.allow_fallback,
        description="In 'auto' budget mode, requests whose drafts do not pay decode autoregressively.",
    )
    max_probe_overhead: float = Field(
        _ENGINE.max_probe_overhead,
        gt=0,
        le=1,
        description="Fallback probes may cost at most this fraction of a request's time.",
    )
    speculation_margin: float = Field(
        _ENGINE.speculation_margin,
        ge=0,
        le=1,
        description="In 'auto' budget mode, a round speculates only where the policy predicts it faster than plain "
        "decoding by more than this share.",
    )
    max_explore_share: float = Field(
        _ENGINE.max_explore_share,
        ge=0,
        le=0.5,
        description="In 'auto' budget mode, the engine measures the tokens/s of rounds run as the "
        "policy plans them and of plain decoding, per batch size, runs the faster, and the other in at most this "
        "share of the time (so that a change of load is seen). 0: the policy alone (docs/engine.md).",
    )
    max_folded_prompt_tokens: int = Field(
        _ENGINE.max_folded_prompt_tokens,
        ge=0,
        description="Prompts of newly admitted requests join the round's verify pass while they sum to at most "
        "this many tokens, so that an admission costs no pass of its own (a pass reads every weight); longer ones, "
        "or arrivals while nothing else runs, are prefilled in a pass of their own. 0: always a pass of their own.",
    )
    ngram_tokens: int = Field(
        _ENGINE.ngram_tokens,
        ge=0,
        description="In 'auto' budget mode, up to this many tokens proposed from the request's own history "
        "(prompt lookup) join its draft tree, or are verified alone by a request in fallback. 0: none.",
    )
    pipeline: bool | Literal["auto"] = Field(
        _ENGINE.pipeline,
        description="Two request groups in flight: the drafter actor drafts one while the target actor "
        "verifies the other. Pays when the drafter has its own device and verify passes are "
        "compute-bound (large batches); 'auto' decides each phase from the cost model; see "
        "docs/serving.md.",
    )
    stream_interval_ms: float = Field(
        100.0,
        ge=0,
        description="A streamed request gets a chunk at most this often; the rounds' tokens in between go "
        "out together in the next one (the first and the last chunk are never held back). Every chunk crosses the "
        "engine replica, the ingress and Serve's proxy, a few ms of CPU each (docs/serving.md): fewer chunks leave "
        "that CPU to the model. 0: a chunk every round.",
    )
    max_stream_chunks_per_s: float | None = Field(
        None,
        gt=0,
        description="All of a replica's streams together get at most about this many chunks per second: with "
        "more open streams than this times stream_interval_ms / 1000, each stream's interval grows to their number "
        "over this. For replicas whose proxy and event loop share the model's cores (CPU serving), where every "
        "chunk's wake-ups slow the model's threads. None: no bound.",
    )
    max_round_seconds: float = Field(
        600.0,
        gt=0,
        description="An engine round running longer than this fails the replica's health check (a hung "
        "worker actor answers nothing and raises nothing), so that Serve replaces the replica.",
    )
    placement: Literal["cpu", "gpu-per-worker", "shared-gpu"] = Field(
        "cpu", description="Where an engine replica's target and drafter actors run (see module docstring)."
    )
    engine_num_cpus: float = Field(0.5, gt=0, description="CPUs reserved for the engine replica (scheduler loop).")
    worker_num_cpus: float = Field(
        0.75,
        gt=0,
        description="CPUs reserved for each worker actor. On placement 'cpu' the two share one bundle "
        "of twice this, and each runs as many threads as the replica holds CPUs (they take turns).",
    )
    worker_torch_threads: PositiveInt | None = Field(
        None,
        description="torch threads in each worker actor. None: what the placement gives it: on 'cpu' every "
        "CPU the replica holds (engine + workers, rounded down; the target and the drafter take turns on them), on "
        "GPUs its own bundle's CPUs. Capped at the cores the actor's process may use.",
    )
    round_nice: int | None = Field(
        -10,
        ge=-20,
        le=19,
        description="Unix nice value of the threads that run the engine's rounds: the replica's engine loop and "
        "the worker actors' compute threads (deployments/priority.py). Below 0 they preempt the node's other "
        "processes (Ray's, Serve's), whose wake-ups otherwise stall the model's parallel regions on CPU serving. "
        "Needs CAP_SYS_NICE (root): without it they keep their value, with a warning. None: left as they are.",
    )
    gil_switch_interval_ms: float | None = Field(
        0.2,
        gt=0,
        allow_inf_nan=False,
        description="Python's thread switch interval in the engine replica's process (sys.setswitchinterval): how "
        "long a thread that wants the GIL waits before the thread holding it must let go. The engine loop thread "
        "takes each worker's reply while the event loop thread streams outputs and serves HTTP; at Python's 5 ms a "
        "reply can wait that long for the GIL. None: Python's default.",
    )
    worker_env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment variables of the worker actors, set over their defaults (deployments/config.py: "
        "OpenMP waits, 2 MB pages for the weights), e.g. {THP_MEM_ALLOC_ENABLE: '0'} keeps their memory on 4 KB "
        "pages. A worker actor also inherits the replica's environment (the application's runtime_env), except "
        "for the variables it sets itself.",
    )
    channel_poll_ms: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="How long the engine replica and its worker actors poll their channels for the next message "
        "before they block (deployments/channel.py). 0: they block at once and pay a process wake-up per message. "
        "Polling saves part of that where each process has a core of its own to poll on (whole CPUs for the replica "
        "and each worker, the model on GPUs); set it longer than a round (e.g. 100) so that a busy replica's calls "
        "never block. On 'cpu' keep 0: the cores a process would poll on are the ones the model computes on.",
    )
    num_replicas: PositiveInt | None = Field(
        None, description="Fixed number of engine replicas. Give this or `autoscaling_config`, not both."
    )
    autoscaling_config: dict[str, Any] | None = Field(
        None,
        description="Ray Serve autoscaling of the engine replicas on ongoing requests, e.g. "
        "{min_replicas: 1, max_replicas: 4, target_ongoing_requests: 16}.",
    )
    ingress: Literal["engine", "separate"] = Field(
        "engine",
        description="Where the OpenAI API runs: 'engine', in each engine replica (one deployment: a "
        "streamed chunk crosses one Ray hop, replica -> Serve's proxy); 'separate', an ingress deployment of its own "
        "in front of the engine replicas (two hops per chunk; its replicas scale apart, num_ingress_replicas).",
    )
    num_ingress_replicas: PositiveInt = Field(
        1, description="Replicas of the HTTP ingress deployment (ingress 'separate' only)."
    )
    api_key: SecretStr | None = Field(
        None, description="If set, every /v1 request needs `Authorization: Bearer <api_key>`."
    )

    @field_validator("speculation", mode="before")
    @classmethod
    def _yaml_off(cls, speculation):
        # YAML 1.1 (PyYAML, hence `serve run`) reads a bare `speculation: off` as the boolean false
        return "off" if speculation is False else speculation

    @field_validator("device")
    @classmethod
    def _check_device(cls, device: str | None) -> str | None:
        if device is not None and device not in ("cpu", "cuda"):
            raise ValueError(
                f"device must be 'cpu' or 'cuda', got {device!r} (each worker actor sees only the GPU "
                f"Ray gave it, as cuda:0: there is no other index to choose)"
            )
        return device

    @field_validator("dtype")
    @classmethod
    def _check_dtype(cls, dtype: str | None) -> str | None:
        if dtype is not None and dtype not in ("float32", "bfloat16", "float16", "float64"):
            raise ValueError(f"dtype must be float32, bfloat16, float16 or float64, got {dtype!r}")
        return dtype

    @field_validator("worker_env")
    @classmethod
    def _check_worker_env(cls, value: dict[str, str]) -> dict[str, str]:
        for key, item in value.items():
            if not key or "=" in key or "\0" in key or "\0" in item:
                raise ValueError(f"worker_env: {key!r}={item!r} is not an environment variable")
        return value

    @field_validator("autoscaling_config")
    @classmethod
    def _check_autoscaling(cls, config: dict | None) -> dict | None:
        if config is not None:
            from ray.serve.config import AutoscalingConfig

            # Serve's own model accepts unknown keys (a misspelled max_replicas would leave max_replicas at 1)
            unknown = sorted(set(config) - set(AutoscalingConfig.model_fields))
            if unknown:
                raise ValueError(
                    f"autoscaling_config: unknown key(s) {unknown}; Ray Serve's are "
                    f"{sorted(AutoscalingConfig.model_fields)}"
                )
            AutoscalingConfig(**config)  # Serve's own validation, now rather than at deploy time
        return config

    @model_validator(mode="after")
    def _check_consistency(self) -> AppArgs:
        if self.num_replicas is not None and self.autoscaling_config is not None:
            raise ValueError("give num_replicas or autoscaling_config, not both")
        if self.placement == "cpu" and self.device not in (None, "cpu"):
            raise ValueError(f"placement 'cpu' runs the workers on CPUs; device {self.device!r} needs a GPU placement")
        if self.placement != "cpu" and self.device == "cpu":
            raise ValueError(f"placement {self.placement!r} reserves GPUs; use device 'cuda' (or placement 'cpu')")
        if self.budget != "auto" and self.budget > self.max_budget:
            raise ValueError(f"budget {self.budget} is above max_budget {self.max_budget}")
        if self.model is not None and self.drafter is None and self.speculation != "off":
            # (checked here, before placement groups are reserved: the actors would fail to start, and Serve retry)
            raise ValueError(
                f"model {self.model!r} needs its own drafter (drafter: <DFlash checkpoint folder>), or "
                "speculation: off; the shipped drafter is for the embedded default model only"
            )
        return self

    # ------------------------------------------------------------------------------------------------------------
    # Derived settings

    def engine_config(self) -> EngineConfig:
        """The engine's settings: the args named as EngineConfig's fields."""
        from dataclasses import fields

        return EngineConfig(**{f.name: getattr(self, f.name) for f in fields(EngineConfig)})

    @property
    def worker_device(self) -> str:
        return self.device or ("cpu" if self.placement == "cpu" else "cuda")

    @property
    def needs_drafter(self) -> bool:
        return self.speculation != "off"

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.model is None:
            return DEFAULT_SERVED_MODEL_NAME
        return os.path.basename(self.model.rstrip("/")) or self.model

    @property
    def engine_max_ongoing_requests(self) -> int:
        # Serve must hand every request to the engine, whose own queue answers 429 when full (Serve's router would
        # otherwise hold the excess where no one can report it). Beyond the engine's own limits: one completions
        # request's batch of prompts arriving at once (each an engine call, refused at once if the queue is full),
        # and 8 for the ingress's own calls (/health's `ready`, `info`), so that they are not queued behind a full
        # replica's requests.
        from deployments.protocol import MAX_PROMPTS_PER_REQUEST

        return self.max_num_seqs + self.max_waiting + MAX_PROMPTS_PER_REQUEST + 8

    def worker_layout(self) -> WorkerLayout:
        cpu = self.worker_num_cpus
        engine_bundle = {"CPU": self.engine_num_cpus}
        if self.placement == "cpu":
            # one bundle for both workers: they take turns on its cores (without a drafter the target takes it all)
            share = cpu if self.needs_drafter else 2 * cpu
            return WorkerLayout(
                [engine_bundle, {"CPU": 2 * cpu}],
                "STRICT_PACK",
                target=ActorPlace(1, 0.0, share),
                drafter=ActorPlace(1, 0.0, share) if self.needs_drafter else None,
            )
        if self.placement == "gpu-per-worker":
            bundles = [engine_bundle, {"CPU": cpu, "GPU": 1.0}]
            if self.needs_drafter:
                bundles.append({"CPU": cpu, "GPU": 1.0})
            return WorkerLayout(
                bundles,
                "STRICT_PACK",
                target=ActorPlace(1, 1.0, cpu),
                drafter=ActorPlace(2, 1.0, cpu) if self.needs_drafter else None,
            )
        # shared-gpu: one bundle, one GPU, both actors in it with half of it each
        share = 0.5 if self.needs_drafter else 1.0
        bundles = [engine_bundle, {"CPU": cpu * (2 if self.needs_drafter else 1), "GPU": 1.0}]
        return WorkerLayout(
            bundles,
            "STRICT_PACK",
            target=ActorPlace(1, share, cpu),
            drafter=ActorPlace(1, share, cpu) if self.needs_drafter else None,
        )

    @property
    def workers_overlap(self) -> bool:
        """Whether the target and the drafter have cores or devices of their own, so that their calls can run at
        the same time (two request groups in flight pay only then)."""
        return self.placement == "gpu-per-worker"

    @property
    def worker_threads(self) -> int:
        """torch CPU threads of each worker actor (see `worker_torch_threads`)."""
        if self.worker_torch_threads is not None:
            return self.worker_torch_threads
        if self.placement == "cpu":
            return max(1, int(sum(b["CPU"] for b in self.worker_layout().bundles) + 1e-9))
        return max(1, int(self.worker_num_cpus + 1e-9))


@dataclass(frozen=True)
class ActorPlace:
    bundle_index: int
    num_gpus: float
    num_cpus: float


@dataclass(frozen=True)
class WorkerLayout:
    bundles: list[dict[str, float]]
    strategy: str
    target: ActorPlace
    drafter: ActorPlace | None


@dataclass(frozen=True)
class WorkerSpec:
    """What each worker actor needs to build its worker (plain data, sent to the actors)."""

    model: str | None
    drafter: str | None
    device: str
    dtype: str | None
    max_num_seqs: int
    kv_cache_bytes: int | None
    attention: str
    torch_threads: int
    workers_overlap: bool = False  # the two workers have cores or devices of their own
    channel_poll_seconds: float = 0.0  # how long a channel end polls before it blocks (deployments/channel.py)
    env: dict[str, str] = field(default_factory=dict)  # environment variables over the workers' defaults
    nice: int | None = None  # the compute threads' nice value (`round_nice`; None: unchanged)

    @classmethod
    def from_args(cls, args: AppArgs) -> WorkerSpec:
        return cls(
            args.model,
            args.drafter,
            args.worker_device,
            args.dtype,
            args.max_num_seqs,
            args.kv_cache_bytes,
            args.attention,
            args.worker_threads,
            args.workers_overlap,
            args.channel_poll_ms / 1000,
            dict(args.worker_env),
            args.round_nice,
        )


class IngressSettings(BaseModel):
    """The ingress's settings that change in place: its deployment's `user_config` (Serve calls the ingress's
    `reconfigure`; nothing restarts, no model reloads). build_app sets it from the args; a `user_config` under
    `deployments: - name: OpenAIIngress` in ray_config.yaml overrides the keys it names."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    served_model_name: str | None = None
    api_key: SecretStr | None = None
    default_max_tokens: PositiveInt | None = None

    @classmethod
    def of(cls, args: AppArgs, user_config: dict | None = None) -> IngressSettings:
        """The args' values, overridden by the keys `user_config` names (an unknown key or a bad value: an error)."""
        if user_config is not None and not isinstance(user_config, dict):
            raise ValueError(f"the OpenAIIngress user_config must be a mapping, got {type(user_config).__name__}")
        base = {
            "served_model_name": args.served_model_name,
            "api_key": args.api_key,
            "default_max_tokens": args.default_max_tokens,
        }
        return cls.model_validate({**base, **(user_config or {})})

    def user_config(self) -> dict:
        """As Serve stores it (plain JSON values), without the API key: Serve shows a deployment's user_config in its
        details and dashboard (a key there is the user's own choice, when rotating it in ray_config.yaml)."""
        return {"served_model_name": self.served_model_name, "default_max_tokens": self.default_max_tokens}


def parse_args(args: dict | AppArgs | None) -> AppArgs:
    """`AppArgs` from a dict; pydantic's ValidationError (a ValueError) names every bad field."""
    if isinstance(args, AppArgs):
        return args
    if args is not None and not isinstance(args, dict):
        raise ValueError(f"build_app args must be a dict, got {type(args).__name__}")
    return AppArgs.model_validate(args or {})
