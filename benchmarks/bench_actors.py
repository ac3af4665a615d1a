"""Per-round overhead of running the workers on Ray actors (as an engine replica does) vs in the engine's process.

    python benchmarks/bench_actors.py                       # embedded SmolLM2 + shipped drafter, CPU
    python benchmarks/bench_actors.py --budget 16 --concurrency 4 --max-tokens 64
    python benchmarks/bench_actors.py --speculation off --concurrency 1 --threads 1 --poll-ms 200
    python benchmarks/bench_actors.py --budget 4 --concurrency 1 --threads 2 --target-here

The same prompts are decoded with the same engine settings (a fixed budget, so that every mode does the same
work per round, and T=0, so that the outputs must be identical) by:
  in-process   Engine + workers in this process (as ddtree.LLM)
  actors       Engine here, target and drafter each on a Ray actor, called through deployments/proxies.py
               over their channels (features sent target -> drafter over a channel of their own)
  target here  (`--target-here`) the Engine and the target in this process, the drafter on a Ray actor that this
               process sends the features to: the layout of an engine loop moved into the target actor's process
  actors, poll the same with every channel end polling up to `--poll-ms` before it blocks (the app's
               `channel_poll_ms`, deployments/channel.py); with `--threads 1` the polling process and the computing
               one each have a core here, as the processes of a GPU replica with whole CPUs would
After a warm-up pass of each, the modes alternate for `--passes` measured passes (so that load from other jobs on
the machine hits both alike); the table reports every measured round. The table shows the mean round time, the actor
call overhead per round (wall time of the proxy calls minus the time the actors spent working), tokens/s, and the round
split into the engine's stages (draft is timed around the drafter call, hops included; verify and accept inside the
target; "other" is the rest: admission, the verify call's hop); then the spread of the drafting rounds' draft and
verify times (where one process and two differ most: the tail); last, the bare cost of one actor round trip and of a
call taking features another actor returned.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# The in-process engine's OpenMP threads wait, and its memory takes pages, as the worker actors' do (before torch).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from deployments.config import use_worker_env  # noqa: E402

use_worker_env()

# Engine stages (RoundTimings): draft is timed around the drafter call (hops included), verify and accept inside the
# target worker (hops excluded).
from ddtree.engine import ROUND_STAGES as STAGES  # noqa: E402


@dataclass
class Result:
    name: str
    round_seconds: list[float] = field(default_factory=list)
    # per drafting round: the draft's seconds (around the drafter call) and the verify's (inside the target)
    draft_seconds: list[float] = field(default_factory=list)
    verify_seconds: list[float] = field(default_factory=list)
    num_tokens: int = 0
    seconds: float = 0.0
    hop_seconds: float = 0.0
    hop_calls: int = 0
    outputs: list[list[int]] = field(default_factory=list)
    tau: float | None = None
    stage_seconds: dict[str, float] = field(default_factory=dict)  # engine.timings over the run


def run_engine(engine, prompts, params, concurrency: int, name: str, hops=None) -> Result:
    from ddtree.scheduler import EngineFullError

    result = Result(name)
    timings0 = engine.timings.as_dict()
    hop_s0, hop_c0 = (hops.seconds, hops.num_calls) if hops is not None else (0.0, 0)
    finals = {}
    order = []
    taus = []
    t0 = time.perf_counter()
    pending = list(prompts)
    while pending or engine.has_unfinished_requests():
        while pending and engine.num_running + engine.num_waiting < concurrency:
            try:
                order.append(engine.add_request(pending[0], params))
            except EngineFullError:
                break
            pending.pop(0)
        r0 = time.perf_counter()
        draft0, verify0 = engine.timings.draft, engine.timings.verify
        outputs = engine.step()
        result.round_seconds.append(time.perf_counter() - r0)
        if engine.timings.draft > draft0:
            result.draft_seconds.append(engine.timings.draft - draft0)
            result.verify_seconds.append(engine.timings.verify - verify0)
        for out in outputs:
            if out.finished:
                finals[out.request_id] = out
    result.seconds = time.perf_counter() - t0
    timings1 = engine.timings.as_dict()
    result.stage_seconds = {k: timings1[k] - timings0[k] for k in STAGES}
    for rid in order:
        result.outputs.append(finals[rid].token_ids)
        result.num_tokens += len(finals[rid].token_ids)
        taus.extend(finals[rid].acceptance_lengths)
    result.tau = statistics.fmean(taus) if taus else None
    if hops is not None:
        result.hop_seconds = hops.seconds - hop_s0
        result.hop_calls = hops.num_calls - hop_c0
    return result


def _spread(seconds: list[float]) -> str:
    """'p50 / p90 / mean' in ms ('-' for none)."""
    if not seconds:
        return "-"
    deciles = statistics.quantiles(seconds * 2 if len(seconds) == 1 else seconds, n=10, method="inclusive")
    return f"{1000 * deciles[4]:.2f} / {1000 * deciles[8]:.2f} / {1000 * statistics.fmean(seconds):.2f}"


def bare_hops(num_calls: int, feature_shape: tuple[int, int]) -> tuple[float, float]:
    """Seconds per no-op actor round trip, and per round trip of a call whose argument is a features object that
    another actor returned earlier (as the drafter's call takes the features a verify returned; the wire format of
    deployments/actors.py)."""
    import ray
    import torch

    from deployments.worker_ops import tensor_from_wire, tensor_to_wire

    @ray.remote(num_cpus=0)
    class Echo:
        def noop(self):
            return None

        def make(self, rows, cols):
            return [rows], tensor_to_wire(torch.randn(rows, cols))  # [num_tokens, num_feature_dims]

        def take(self, features):
            return tensor_from_wire(features[1]).shape[0]

    a, b = Echo.remote(), Echo.remote()
    ray.get([a.noop.remote(), b.noop.remote()])
    t0 = time.perf_counter()
    for _ in range(num_calls):
        ray.get(a.noop.remote())
    noop = (time.perf_counter() - t0) / num_calls
    refs = [a.make.remote(*feature_shape) for _ in range(num_calls)]
    ray.wait(refs, num_returns=len(refs))
    t0 = time.perf_counter()
    for ref in refs:
        ray.get(b.take.remote(ref))
    handoff = (time.perf_counter() - t0) / num_calls
    for actor in (a, b):
        ray.kill(actor)
    return noop, handoff


class FeedingDrafterProxy:
    """A drafter actor called from the process that holds the target: the features the engine takes from the local
    target go to the drafter's feature channel as a numbered batch right before each Draft names it (where the
    target actor pushes them itself in deployments/actors.py)."""

    can_overlap = False

    def __init__(self, actor, info: dict, hops) -> None:
        import torch

        from deployments.channel import ChannelClient
        from deployments.worker_ops import WIRE, FeatureBatch, tensor_to_wire

        self.actor = actor
        self.channel = ChannelClient(info["channel"], "drafter worker", codec=WIRE)
        self.features = ChannelClient(info["features"], "drafter worker (features)")
        self.block_len = info["block_len"]
        self.hops = hops
        self.num_batches = 0
        self.features.send(FeatureBatch(0, [], [], tensor_to_wire(torch.zeros(0))))

    def _call(self, op, convert=None):
        from deployments.proxies import PendingCall

        return PendingCall(self.channel, self.hops, op, convert=convert)

    def draft_async(self, request_ids, roots, features, max_k):
        import torch

        from deployments.proxies import _draft_from_wire
        from deployments.worker_ops import Draft, FeatureBatch, tensor_to_wire

        self.num_batches += 1
        counts = [f.shape[0] for f in features]
        self.features.send(
            FeatureBatch(self.num_batches, list(request_ids), counts, tensor_to_wire(torch.cat(features)))
        )
        return self._call(Draft(list(request_ids), list(roots), max_k, self.num_batches), convert=_draft_from_wire)

    def draft(self, request_ids, roots, features, max_k):
        return self.draft_async(request_ids, roots, features, max_k).result()

    def free(self, request_id) -> None:
        from deployments.worker_ops import FreeDraft

        self._call(FreeDraft(request_id, self.num_batches)).result()

    def measure_draft_cost(self, batch_sizes, max_k):
        from deployments.worker_ops import MeasureDraftCost

        return self._call(MeasureDraftCost(list(batch_sizes), max_k)).result()

    def kill(self) -> None:
        import ray

        self.channel.close()
        self.features.close()
        ray.kill(self.actor)


def start_feeding_drafter(spec, place, target, hops) -> FeedingDrafterProxy:
    """A drafter actor (no target actor) on the local target's embedding and LM head."""
    import ray

    from deployments.actors import DrafterActor, _actor_options

    head = target.model.head().to("cpu")
    actor = ray.remote(DrafterActor).options(**_actor_options(spec, place, None)).remote(spec, head)
    return FeedingDrafterProxy(actor, ray.get(actor.describe.remote()), hops)


def make_random_drafter(model: str | None, out: Path, block_size: int = 8) -> Path:
    """A randomly initialised 1-layer DFlash drafter for the target (its drafts are poor, but at a fixed budget a
    round does the same work as with a trained drafter, which is what this benchmark compares)."""
    import json

    import torch

    from ddtree.models.dflash import DFlashConfig, DFlashDraftModel, save_dflash

    if model is None:
        from ddtree.models.default import default_target_dir

        target_dir = default_target_dir()
    else:
        target_dir = Path(model)
    t = json.loads((target_dir / "config.json").read_text())
    num_layers = t["num_hidden_layers"]
    config = DFlashConfig(
        hidden_size=t["hidden_size"],
        intermediate_size=t["intermediate_size"],
        num_hidden_layers=1,
        num_attention_heads=t["num_attention_heads"],
        num_key_value_heads=t["num_key_value_heads"],
        head_dim=t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"],
        rms_norm_eps=t.get("rms_norm_eps", 1e-6),
        rope_theta=t.get("rope_theta", 10000.0),
        vocab_size=t["vocab_size"],
        max_position_embeddings=t["max_position_embeddings"],
        block_size=block_size,
        num_target_layers=num_layers,
        mask_token_id=0,
        target_layer_ids=[1, num_layers // 2, num_layers - 3],
    )
    torch.manual_seed(0)
    save_dflash(DFlashDraftModel(config), config, out, dtype=torch.float32)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="target (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument(
        "--drafter", default=None, help="DFlash drafter (default: the shipped one); 'random': a random 1-layer drafter"
    )
    parser.add_argument("--speculation", default="ddtree", choices=("ddtree", "dflash", "off"))
    parser.add_argument("--budget", type=int, default=16, help="fixed nodes per request (same work in each mode)")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=2, help="requests decoded together")
    parser.add_argument("--num-cpus", type=int, default=2, help="Ray's CPUs (this machine: 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the engine and of each actor")
    parser.add_argument("--passes", type=int, default=2, help="measured passes per mode, alternating")
    parser.add_argument(
        "--poll-ms", type=float, default=None, help="also run actors whose channels poll this long before blocking"
    )
    parser.add_argument(
        "--target-here",
        action="store_true",
        help="also run the engine and the target in this process with the drafter on an actor",
    )
    args = parser.parse_args(argv)
    if args.target_here and args.speculation == "off":
        parser.error("--target-here needs a drafter (speculation ddtree or dflash)")
    if args.drafter == "random":
        args.drafter = str(make_random_drafter(args.model, Path("work/bench_actors/random-drafter")))

    import ray
    import torch

    from ddtree.engine import Engine, EngineConfig
    from ddtree.loaders import build_workers
    from ddtree.sampling_params import SamplingParams
    from ddtree.training.prompts import load_eval_prompts
    from deployments.actors import start_worker_actors
    from deployments.config import AppArgs, WorkerSpec

    torch.set_num_threads(args.threads)
    app_args = AppArgs(
        model=args.model,
        drafter=args.drafter,
        speculation=args.speculation,
        budget=args.budget,
        max_budget=max(args.budget, 1),
        max_num_seqs=args.concurrency,
        worker_torch_threads=args.threads,
    )
    # No fallback: the budget policy would decide from live timings, which differ between the modes.
    config = EngineConfig(
        speculation=args.speculation,
        budget=args.budget,
        max_budget=args.budget,
        max_num_seqs=args.concurrency,
        allow_fallback=False,
    )
    need_drafter = args.speculation != "off"
    target, drafter, tokenizer = build_workers(
        args.model,
        args.drafter,
        device="cpu",
        dtype=None,
        need_drafter=need_drafter,
        kv_cache_bytes=None,
        attention="auto",
    )
    texts = [p for c in ("chat", "code", "math") for p in load_eval_prompts(c)][: args.num_prompts]
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for t in texts
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    local_engine = Engine(config, target, drafter, tokenizer)
    cost = copy.deepcopy(local_engine.budget.cost)  # the actors' engine starts from the same cost model

    polls = [("actors", 0.0)] + ([(f"actors, poll {args.poll_ms:g} ms", args.poll_ms / 1000)] if args.poll_ms else [])
    # Each set of actors reserves a replica's CPUs: Ray is given that many per set (the modes take turns)
    ray.init(num_cpus=args.num_cpus * (len(polls) + args.target_here), include_dashboard=False, log_to_driver=False)
    layout = app_args.worker_layout()
    # (name, engine, its actors or None): each mode's engine starts from the same cost model
    modes = [("in-process", local_engine, None)]
    if args.target_here:
        from deployments.proxies import HopTimes

        feeding = start_feeding_drafter(WorkerSpec.from_args(app_args), layout.drafter, target, HopTimes())
        here = Engine(config, target, feeding, tokenizer, cost=cost)
        modes.append(("target here", here, feeding))  # (its hops, and kill(), as the actors' sets have)
    for name, poll_seconds in polls:
        spec = dataclasses.replace(WorkerSpec.from_args(app_args), channel_poll_seconds=poll_seconds)
        actors = start_worker_actors(spec, layout.target, layout.drafter)
        engine = Engine(config, actors.target_proxy, actors.drafter_proxy, actors.target_proxy.tokenizer, cost=cost)
        modes.append((name, engine, actors))
    for _, engine, actors in modes:
        run_engine(engine, prompts, params, args.concurrency, "warm-up", actors.hops if actors else None)
        if actors is not None:
            actors.hops.by_op.clear()  # (the measured passes only)
    results = [Result(name) for name, _, _ in modes]
    for _ in range(args.passes):
        for total, (name, engine, actors) in zip(results, modes):
            run = run_engine(engine, prompts, params, args.concurrency, name, actors.hops if actors else None)
            total.round_seconds += run.round_seconds
            total.draft_seconds += run.draft_seconds
            total.verify_seconds += run.verify_seconds
            total.num_tokens += run.num_tokens
            total.seconds += run.seconds
            total.hop_seconds += run.hop_seconds
            total.hop_calls += run.hop_calls
            total.outputs = run.outputs
            for k, v in run.stage_seconds.items():
                total.stage_seconds[k] = total.stage_seconds.get(k, 0.0) + v
            total.tau = run.tau
    noop, handoff = bare_hops(200, (8, 3 * 576))
    for _, _, actors in modes[1:]:
        actors.kill()
    ray.shutdown()

    local = results[0]
    same = all(r.outputs == local.outputs for r in results)
    print(
        f"\n{len(prompts)} prompts, max_tokens={args.max_tokens}, concurrency={args.concurrency}, "
        f"speculation={args.speculation}, budget={args.budget}, {args.threads} torch thread(s); "
        f"outputs identical: {same}"
    )
    width = max(len(r.name) for r in results) + 2
    print(
        f"{'mode':<{width}}{'rounds':>8}{'round ms':>10}{'p50 ms':>9}{'hop ms/round':>14}{'calls/round':>13}"
        f"{'tokens/s':>10}{'tau':>7}"
    )
    for r in results:
        n = len(r.round_seconds)
        print(
            f"{r.name:<{width}}{n:>8}{1000 * statistics.fmean(r.round_seconds):>10.2f}"
            f"{1000 * statistics.median(r.round_seconds):>9.2f}{1000 * r.hop_seconds / n:>14.2f}"
            f"{r.hop_calls / n:>13.2f}{r.num_tokens / r.seconds:>10.1f}"
            f"{r.tau if r.tau is not None else float('nan'):>7.2f}"
        )
    print("per round, ms: " + "  ".join(f"{k:>8}" for k in STAGES) + "     other")
    for r in results:
        n = len(r.round_seconds)
        staged = sum(r.stage_seconds.values())
        print(
            f"{r.name:<{width}}  "
            + "  ".join(f"{1000 * r.stage_seconds[k] / n:>8.2f}" for k in STAGES)
            + f"  {1000 * (sum(r.round_seconds) - staged) / n:>8.2f}"
        )
    if any(r.draft_seconds for r in results):
        print("drafting rounds, ms: draft (hops included) and verify (inside the target), p50 / p90 / mean")
        for r in results:
            print(f"{r.name:<{width}}  draft {_spread(r.draft_seconds)}  verify {_spread(r.verify_seconds)}")
    for r in results[1:]:
        extra = statistics.fmean(r.round_seconds) - statistics.fmean(local.round_seconds)
        print(
            f"{r.name} - in-process: {1000 * extra:+.2f} ms per round "
            f"({100 * extra / statistics.fmean(local.round_seconds):+.1f}%)"
        )
    for name, _, actors in modes[1:]:
        print(
            f"worker calls of '{name}', ms each (there: submission until the worker began, pickling and the worker's "
            "wake-up included; back: the worker's end until the result was read, of which wait: until it began to "
            "arrive):"
        )
        for op, (calls, there, back, wait) in sorted(actors.hops.by_op.items(), key=lambda kv: -kv[1][0]):
            print(
                f"  {op:<14}{calls:>6} calls  there {1000 * there / calls:6.3f}  back {1000 * back / calls:6.3f}"
                f"  (wait {1000 * wait / calls:6.3f})"
            )
    print(
        f"bare no-op actor round trip: {1000 * noop:.2f} ms; a call taking features actor A returned earlier "
        f"(8 x 1728 fp32) to actor B: {1000 * handoff:.2f} ms"
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
