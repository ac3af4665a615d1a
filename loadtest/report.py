"""The sweep's report: the combined table (markdown and CSV), the goals it is measured against, the agreement of the
servers' T=0 outputs, and the plots (matplotlib).

    write_all(results, folder) -> str    writes table.md, table.csv, throughput.png, latency.png; returns table.md
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

REFERENCE = "ddtree-off"  # the ratio column: against plain decoding of the same engine
COLUMNS = (
    "server",
    "users",
    "passes",
    "output_tok_s",
    "tok_s_min",
    "tok_s_max",
    "x_off",
    "completed",
    "failed",
    "unfinished",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "e2e_p50_s",
    "goodput_req_s",
    "slo_attainment",
    "tokens_per_round",
    "locust_requests",
    "locust_failures",
)


def _metric(summary: dict, name: str, q: str) -> float | None:
    d = summary.get("metrics", {}).get(name)
    return None if d is None else d.get(q)


def _run_row(r: dict) -> dict:
    s = r["summary"]
    e2e = _metric(s, "e2e_latency_ms", "p50")
    spec = s.get("speculation") or {}
    return {
        "server": r["server"],
        "users": r["concurrency"],
        "output_tok_s": s["overall_output_tokens_per_s"],
        "completed": s["num_completed_requests"],
        "failed": s["num_failed_requests"],
        "unfinished": s["num_unfinished_requests"],
        "ttft_p50_ms": _metric(s, "ttft_ms", "p50"),
        "ttft_p99_ms": _metric(s, "ttft_ms", "p99"),
        "itl_p50_ms": _metric(s, "itl_ms", "p50"),
        "itl_p99_ms": _metric(s, "itl_ms", "p99"),
        "tpot_p50_ms": _metric(s, "tpot_ms", "p50"),
        "tpot_p99_ms": _metric(s, "tpot_ms", "p99"),
        "e2e_p50_s": None if e2e is None else e2e / 1000,
        "goodput_req_s": s.get("goodput_requests_per_s"),
        "slo_attainment": s.get("slo_attainment"),
        "tokens_per_round": spec.get("output_tokens_per_round"),
        "locust_requests": r.get("locust", {}).get("num_requests"),
        "locust_failures": r.get("locust", {}).get("num_failures"),
    }


SUMMED = ("completed", "failed", "unfinished", "locust_requests", "locust_failures")


def rows(results: dict) -> list[dict]:
    """One row per server and concurrency, in the order first run. With several passes, counts are summed over the
    passes and every other number is their mean; `tok_s_min` and `tok_s_max` give the range of output tokens/s."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in results["runs"]:
        groups.setdefault((r["server"], r["concurrency"]), []).append(_run_row(r))
    out = []
    for (server, users), runs in groups.items():
        row = {"server": server, "users": users, "passes": len(runs)}
        for key in runs[0]:
            if key in row:
                continue
            values = [run[key] for run in runs if run[key] is not None]
            if key in SUMMED:
                row[key] = sum(values) if values else None
            else:
                row[key] = sum(values) / len(values) if values else None
        row["tok_s_min"] = min(run["output_tok_s"] for run in runs)
        row["tok_s_max"] = max(run["output_tok_s"] for run in runs)
        out.append(row)
    reference = {row["users"]: row["output_tok_s"] for row in out if row["server"] == REFERENCE}
    for row in out:
        ref = reference.get(row["users"])
        row["x_off"] = row["output_tok_s"] / ref if ref else None
    return out


def goals(results: dict) -> list[tuple[str, str]]:
    """(goal, what was measured) for each goal the sweep can speak to."""
    concurrency = results["settings"]["concurrency"]
    table = rows(results)
    tok_s = {(r["server"], r["users"]): r["output_tok_s"] for r in table}
    out = []

    def ratio(a: str, b: str, users: int) -> float | None:
        return tok_s[(a, users)] / tok_s[(b, users)] if (a, users) in tok_s and tok_s.get((b, users)) else None

    def check(goal: str, ratios: list[tuple[int, float | None]], bound: float) -> None:
        measured = [(c, x) for c, x in ratios if x is not None]
        if not measured:
            out.append((goal, "not measured"))
            return
        met = all(x >= bound for _, x in measured)
        text = ", ".join(f"{x:.2f}x at {c}" for c, x in measured)
        out.append((goal, f"{'met' if met else 'NOT met'}: {text}"))

    bad = [
        f"{r['server']} at {r['users']}: {r['failed']} failed, {r['unfinished']} unfinished"
        for r in table
        if r["failed"] or r["unfinished"]
    ]
    out.append(("no failed or unfinished request in any run", f"NOT met: {'; '.join(bad)}" if bad else "met"))
    if 16 in concurrency:
        check("ddtree-auto >= 5x hf at 16 users", [(16, ratio("ddtree-auto", "hf", 16))], 5.0)
    check(
        "ddtree-auto >= 1.5x vllm at every concurrency",
        [(c, ratio("ddtree-auto", "vllm", c)) for c in concurrency],
        1.5,
    )
    check(
        "ddtree-auto >= 0.98x ddtree-off at every concurrency",
        [(c, ratio("ddtree-auto", REFERENCE, c)) for c in concurrency],
        0.98,
    )
    if 1 in concurrency:
        check("ddtree-auto >= 1.3x ddtree-off at 1 user", [(1, ratio("ddtree-auto", REFERENCE, 1))], 1.3)
    return out


def agreement(outputs: dict[str, list[str | None]]) -> dict:
    """How many of the check prompts' T=0 texts each server shares with the reference (ddtree-off, else the first
    server)."""
    if not outputs:
        return {}
    reference = REFERENCE if REFERENCE in outputs else next(iter(outputs))
    ref = outputs[reference]
    out = {"reference": reference, "servers": {}}
    for name, texts in outputs.items():
        if name == reference:
            continue
        pairs = [(i, a, b) for i, (a, b) in enumerate(zip(ref, texts)) if a is not None and b is not None]
        differ = [i for i, a, b in pairs if a != b]
        out["servers"][name] = {
            "compared": len(pairs),
            "equal": len(pairs) - len(differ),
            "differ": differ,
            "failed": sum(t is None for t in texts),
        }
    return out


def _fmt(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _starts(stagger_s: float | None) -> str:
    if stagger_s is None:  # (results written before the setting existed)
        return ""
    return f", users started {stagger_s:g} s apart" if stagger_s > 0 else ", users started at once"


def markdown(results: dict) -> str:
    settings = results["settings"]
    slo = settings["slo"]
    passes = settings.get("passes", 1)
    lines = [
        f"`{settings['command']}`",
        "",
        f"{settings['max_tokens']} new tokens at T=0, {settings['num_prompts']} prompts, "
        f"{settings['duration_s']:g} s per run (at most {settings['max_requests']} requests)"
        + _starts(settings.get("stagger_s"))
        + (
            f", {passes} passes in A B B A order (tokens/s: mean and range; latencies: means; counts: sums)"
            if passes > 1
            else ""
        )
        + "; goodput: TTFT <= "
        f"{_fmt(slo['ttft_ms'], 0)} ms and TPOT <= {_fmt(slo['tpot_ms'], 0)} ms.",
        "",
        "| server | users | output tok/s | x off | done | failed | unfinished | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
        "TPOT p50 / p99 ms | e2e p50 s | goodput req/s | tokens/round |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows(results):
        tok_s = _fmt(r["output_tok_s"])
        if r["passes"] > 1:
            tok_s += f" ({_fmt(r['tok_s_min'])}-{_fmt(r['tok_s_max'])})"
        lines.append(
            f"| {r['server']} | {r['users']} | {tok_s} | {_fmt(r['x_off'], 2)} | {r['completed']} "
            f"| {r['failed']} | {r['unfinished']} | {_fmt(r['ttft_p50_ms'], 0)} / {_fmt(r['ttft_p99_ms'], 0)} | "
            f"{_fmt(r['itl_p50_ms'], 0)} / {_fmt(r['itl_p99_ms'], 0)} | {_fmt(r['tpot_p50_ms'], 1)} / "
            f"{_fmt(r['tpot_p99_ms'], 1)} | {_fmt(r['e2e_p50_s'], 2)} | {_fmt(r['goodput_req_s'], 2)} | "
            f"{_fmt(r['tokens_per_round'], 2)} |"
        )
    lines += ["", "Goals:", ""]
    lines += [f"- {goal}: {measured}" for goal, measured in goals(results)]
    agree = results.get("agreement") or {}
    if agree.get("servers"):
        lines += ["", f"T=0 outputs of the check prompts against {agree['reference']}:", ""]
        for name, a in agree["servers"].items():
            differ = f" (differ: prompts {', '.join(map(str, a['differ']))})" if a["differ"] else ""
            failed = f", {a['failed']} failed" if a["failed"] else ""
            lines.append(f"- {name}: {a['equal']}/{a['compared']} identical{differ}{failed}")
    for name, why in (results.get("skipped") or {}).items():
        lines.append(f"- {name} skipped: {why}")
    for name, why in (results.get("failed_servers") or {}).items():
        lines.append(f"- {name} FAILED: {why.splitlines()[0]}")
    if settings.get("interrupted"):
        lines.append("- interrupted: the table holds the runs finished before")
    return "\n".join(lines) + "\n"


def table_csv(results: dict) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=COLUMNS)
    writer.writeheader()
    for r in rows(results):
        writer.writerow({k: ("" if v is None else v) for k, v in r.items()})
    return buffer.getvalue()


def plot(results: dict, folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    table = [r for r in rows(results) if r["completed"]]  # (a run that completed nothing has no point to plot)
    servers = list(dict.fromkeys(r["server"] for r in table))
    concurrency = results["settings"]["concurrency"]
    colors = {s: plt.cm.tab10(i % 10) for i, s in enumerate(servers)}
    title = f"{results['settings']['max_tokens']} new tokens, T=0"
    paths = []

    def axis(ax, ylabel: str, log: bool) -> None:
        ax.set_xscale("log", base=2)
        ax.set_xticks(concurrency)
        ax.set_xticklabels([str(c) for c in concurrency])
        ax.set_xlabel("concurrent users")
        ax.set_ylabel(ylabel)
        if log:
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
            ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(True, which="both", alpha=0.3)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in servers:
        points = [(r["users"], r["output_tok_s"]) for r in table if r["server"] == s]
        ax.plot(*zip(*points), marker="o", color=colors[s], label=s)
    axis(ax, "output tokens/s (all requests)", log=False)
    ax.set_ylim(bottom=0)
    ax.set_title(f"Throughput against concurrency ({title})")
    ax.legend()
    fig.tight_layout()
    paths.append(folder / "throughput.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (metric, label) in zip(
        axes, (("ttft", "TTFT (ms)"), ("itl", "ITL, between chunks (ms)"), ("tpot", "TPOT, per token (ms)"))
    ):
        for s in servers:
            mine = [r for r in table if r["server"] == s]
            for q, style in (("p50", "-"), ("p99", "--")):
                points = [(r["users"], r[f"{metric}_{q}_ms"]) for r in mine if r[f"{metric}_{q}_ms"]]
                if points:
                    ax.plot(*zip(*points), style, marker="o", color=colors[s], label=f"{s} {q}")
        axis(ax, label, log=True)
        ax.set_title(f"{label.split(' (')[0].split(',')[0]}: p50 solid, p99 dashed")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 8), fontsize="small")
    fig.suptitle(f"Latency against concurrency ({title})")
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    paths.append(folder / "latency.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


def write_all(results: dict, folder: Path) -> str:
    folder = Path(folder)
    text = markdown(results)
    (folder / "table.md").write_text(text)
    (folder / "table.csv").write_text(table_csv(results))
    if results["runs"]:
        plot(results, folder)
    return text
