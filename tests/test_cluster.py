"""cluster/: the `ray up` config against the schema that ray ships, the KubeRay RayService against KubeRay's CRD, and
the GPU Serve config against ray_config.yaml (only the GPU settings may differ)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml

REPO = Path(__file__).resolve().parent.parent
CLUSTER = REPO / "cluster"
# The args a GPU deployment changes; every other arg of ray_config.yaml must be the same in cluster/serve-gpu.yaml.
GPU_ARGS = {
    "model",
    "drafter",
    "served_model_name",
    "device",
    "dtype",
    "placement",
    "attention",
    "kv_cache_bytes",
    "max_num_seqs",
    "max_budget",
    "engine_num_cpus",
    "worker_num_cpus",
    "round_nice",
    "num_replicas",
    "autoscaling_config",
}
GPU_DEPLOYMENT_OPTIONS = {"health_check_timeout_s"}


def _yaml(path: Path):
    return yaml.safe_load(path.read_text())


def _app(config: dict) -> dict:
    (app,) = config["applications"]
    return app


def test_gpu_serve_config_is_ray_config_with_gpu_settings():
    from ray.serve.schema import ServeDeploySchema

    from deployments.config import parse_args

    cpu, gpu = _yaml(REPO / "ray_config.yaml"), _yaml(CLUSTER / "serve-gpu.yaml")
    ServeDeploySchema.model_validate(gpu)
    cpu_app, gpu_app = _app(cpu), _app(gpu)
    for key in ("name", "route_prefix", "import_path"):
        assert gpu_app[key] == cpu_app[key]
    assert set(cpu_app["args"]) <= set(gpu_app["args"])
    differ = {k for k in gpu_app["args"] if gpu_app["args"][k] != cpu_app["args"].get(k, object())}
    assert differ <= GPU_ARGS, f"not GPU settings: {differ - GPU_ARGS}"
    assert gpu_app["args"]["device"] == "cuda" and gpu_app["args"]["placement"] == "gpu-per-worker"
    parsed = parse_args(gpu_app["args"])  # the app's own validation (paths are not opened here)
    assert parsed.autoscaling_config["target_ongoing_requests"] == parsed.max_num_seqs
    (cpu_dep,), (gpu_dep,) = cpu_app["deployments"], gpu_app["deployments"]
    assert gpu_dep["name"] == cpu_dep["name"] == "DDTreeServer"
    assert {k for k in gpu_dep if gpu_dep[k] != cpu_dep.get(k)} <= GPU_DEPLOYMENT_OPTIONS


def test_ray_up_config_passes_rays_schema_and_its_own_checks():
    from ray.autoscaler._private.util import prepare_config, validate_config

    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    config = _yaml(CLUSTER / "gpu-cluster.yaml")
    jsonschema.validate(config, schema)
    validate_config(prepare_config(config))  # what `ray up` runs (defaults filled in)
    types = config["available_node_types"]
    assert types[config["head_node_type"]]["resources"]["GPU"] == 0  # no engine replica on the head
    gpu_workers = [t for name, t in types.items() if t["resources"].get("GPU", 0) > 0]
    assert gpu_workers and all(t["resources"]["GPU"] >= 2 for t in gpu_workers)  # a gpu-per-worker replica fits
    # every node runs the ray of the project's venv, installed as the README installs it
    commands = config["setup_commands"] + config["head_start_ray_commands"] + config["worker_start_ray_commands"]
    assert any("make install" in c for c in config["setup_commands"])
    assert all("/.venv/bin/ray" in c for c in commands if " ray " in f" {c} " or "ray start" in c)
    # a wrong field is caught by the same check
    bad = dict(config, available_node_types={"head": {"resources": {"CPU": "eight"}, "node_config": {}}})
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def _crd_schema() -> dict:
    with gzip.open(CLUSTER / "schemas" / "ray.io_rayservices.yaml.gz", "rt") as f:
        crd = yaml.safe_load(f)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return version["schema"]["openAPIV3Schema"]


def _unknown_fields(value, schema: dict, path: str = "") -> list[str]:
    """Fields that a structural schema does not declare (what `kubectl apply --validate=strict` refuses and the API
    server otherwise prunes silently)."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    out = []
    if isinstance(value, dict) and "properties" in schema:
        for key, item in value.items():
            if key in schema["properties"]:
                out += _unknown_fields(item, schema["properties"][key], f"{path}.{key}")
            elif not schema.get("additionalProperties"):
                out.append(f"{path}.{key}")
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key, item in value.items():
            out += _unknown_fields(item, schema["additionalProperties"], f"{path}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            out += _unknown_fields(item, schema["items"], f"{path}[{i}]")
    return out


def test_rayservice_passes_kuberays_crd_and_serves_the_gpu_config():
    manifest, schema = _yaml(CLUSTER / "rayservice.yaml"), _crd_schema()
    jsonschema.validate(manifest, schema)
    assert _unknown_fields(manifest, schema) == []
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    serve_config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    assert serve_config["applications"] == _yaml(CLUSTER / "serve-gpu.yaml")["applications"]
    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == ray.__version__
    (worker,) = cluster["workerGroupSpecs"]
    (container,) = worker["template"]["spec"]["containers"]
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 2
    # the checks catch what they should: an unknown field, and a field of the wrong type
    bad = yaml.safe_load((CLUSTER / "rayservice.yaml").read_text())
    bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containerz"] = []
    assert _unknown_fields(bad, schema) == [".spec.rayClusterConfig.workerGroupSpecs[0].template.spec.containerz"]
    bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
