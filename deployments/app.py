"""`build_app(args) -> Application`: the builder named by ray_config.yaml (`import_path: deployments.app:build_app`).

    serve run ray_config.yaml        # this machine, the embedded default model on CPU
    serve run deployments.app:build_app model=/models/Qwen3-8B drafter=/models/Qwen3-8B-DFlash-b16 \
        placement=gpu-per-worker dtype=bfloat16
    serve.run(build_app({"model": ..., "drafter": ..., "placement": "gpu-per-worker"}), name="ddtree")

The args are validated (deployments/config.py: AppArgs) before anything is built; an invalid dict raises pydantic's
ValidationError, a ValueError naming every bad field.
"""

from __future__ import annotations

from ray import serve
from ray.serve import Application

from deployments.config import REPLICA_OPENMP_ENV, AppArgs, IngressSettings, parse_args
from deployments.engine_server import DDTreeEngine
from deployments.ingress import OpenAIIngress

ENGINE_DEPLOYMENT = "DDTreeEngine"
INGRESS_DEPLOYMENT = "OpenAIIngress"
SERVER_DEPLOYMENT = "DDTreeServer"  # ingress "engine": the API and the engine in one deployment
# On a downscale or a redeploy a replica stops receiving new requests and finishes those it holds (an engine replica:
# running and queued, up to max_num_seqs + max_waiting) for up to this long before it is stopped; Serve's default
# (20 s) would cut long answers and whole queues. Override per deployment in ray_config.yaml.
GRACEFUL_SHUTDOWN_TIMEOUT_S = 600.0


def build_app(args: dict | AppArgs | None = None) -> Application:
    parsed = parse_args(args)
    layout = parsed.worker_layout()
    engine_options = {
        "name": SERVER_DEPLOYMENT if parsed.ingress == "engine" else ENGINE_DEPLOYMENT,
        # Bundle 0 holds the replica itself; its actors go in the next bundles (deployments/actors.py).
        # The replica builds trees with torch on the same cores as its worker actors: no spinning OpenMP threads.
        "ray_actor_options": {
            "num_cpus": parsed.engine_num_cpus,
            "runtime_env": {"env_vars": dict(REPLICA_OPENMP_ENV)},
        },
        "placement_group_bundles": layout.bundles,
        "placement_group_strategy": layout.strategy,
        "max_ongoing_requests": parsed.engine_max_ongoing_requests,
        # Loading the models and profiling the verify pass take a while on a CPU.
        "health_check_timeout_s": 120.0,
        # A replica whose engine loop died fails every request sent to it, and Serve's router prefers it (it holds
        # the fewest ongoing requests): checked every 2 s (the check reads two fields), it is replaced within ~6 s
        # (three failed checks) instead of ~30 s.
        "health_check_period_s": 2.0,
        "graceful_shutdown_timeout_s": GRACEFUL_SHUTDOWN_TIMEOUT_S,
    }
    if parsed.autoscaling_config is not None:
        # Serve's default target (2 ongoing requests) would add a replica, a whole model load, for a third request:
        # a replica is full when its batch is (max_num_seqs), unless the config says otherwise
        engine_options["autoscaling_config"] = {
            "target_ongoing_requests": parsed.max_num_seqs,
            **parsed.autoscaling_config,
        }
    else:
        engine_options["num_replicas"] = parsed.num_replicas or 1
    if parsed.ingress == "engine":
        from deployments.server import DDTreeServer

        # the served name, API key and default_max_tokens change in place (OpenAIIngress.reconfigure)
        engine_options["user_config"] = IngressSettings.of(parsed).user_config()
        return serve.deployment(DDTreeServer).options(**engine_options).bind(parsed)
    engine = serve.deployment(DDTreeEngine).options(**engine_options).bind(parsed)
    ingress = (
        serve.deployment(OpenAIIngress)
        .options(
            name=INGRESS_DEPLOYMENT,
            num_replicas=parsed.num_ingress_replicas,
            ray_actor_options={"num_cpus": 0},
            graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_TIMEOUT_S,  # its streams end with the engine's answers
            # the served name, API key and default_max_tokens change in place (OpenAIIngress.reconfigure)
            user_config=IngressSettings.of(parsed).user_config(),
            max_ongoing_requests=parsed.engine_max_ongoing_requests * max(1, _max_engine_replicas(parsed)),
        )
        .bind(engine, parsed)
    )
    return ingress


def _max_engine_replicas(args: AppArgs) -> int:
    if args.autoscaling_config is not None:
        return int(args.autoscaling_config.get("max_replicas", 1))
    return args.num_replicas or 1


def max_ingress_replicas(args: AppArgs) -> int:
    """The most replicas that serve the app's HTTP at once: the engine's with the API inside it, else the API's."""
    return _max_engine_replicas(args) if args.ingress == "engine" else args.num_ingress_replicas
