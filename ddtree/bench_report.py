"""`ddtree bench`'s results: one mode's counts over its passes (`ModeResult`), and the tables and files made from
them (`print_table` and `save` for one concurrency, `print_concurrency_table` and `save_concurrency` for several)."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path


def paired_ratio(rates: list[float], base_rates: list[float]) -> float:
    """Speeds measured pass by pass, over a base's: the median of the passes' own ratios where both ran the same
    passes (the runs of a pass ran side by side, so what the machine drifts between passes cancels out), else the
    ratio of the medians."""
    if rates and len(rates) == len(base_rates) and all(b > 0 for b in base_rates):
        return statistics.median(a / b for a, b in zip(rates, base_rates))
    base = statistics.median(base_rates) if base_rates else 0.0
    return statistics.median(rates) / base if rates and base else 0.0


@dataclass
class ModeResult:
    name: str
    num_tokens: int = 0
    seconds: float = 0.0
    acceptance_lengths: list[int] = field(default_factory=list)
    budgets: list[int] = field(default_factory=list)  # nodes verified per speculative request-round
    num_ngram_tokens: int = 0  # accepted from n-gram chains in rounds without a draft
    timings: dict = field(default_factory=dict)
    outputs: list[list[int]] = field(default_factory=list)
    pass_rates: list[float] = field(default_factory=list)  # tokens/s of each pass
    outputs_vary: bool = False  # a later pass produced other tokens than the first

    @property
    def tokens_per_second(self) -> float:
        if self.pass_rates:
            return statistics.median(self.pass_rates)
        return self.num_tokens / self.seconds if self.seconds else 0.0

    def ratio_to(self, base: ModeResult) -> float:
        """This mode's speed over `base`'s: `paired_ratio` of their passes (without passes: of their totals)."""
        if self.pass_rates and base.pass_rates:
            return paired_ratio(self.pass_rates, base.pass_rates)
        return self.tokens_per_second / base.tokens_per_second if base.tokens_per_second else 0.0

    def extend(self, run: ModeResult) -> None:
        """Add a later group of the same pass."""
        self._add_counts(run)
        self.outputs += run.outputs

    def absorb(self, run: ModeResult) -> None:
        """Add one pass of this mode (the first pass included: `record` starts from an empty result)."""
        if self.pass_rates:
            self.outputs_vary |= run.outputs != self.outputs
        else:
            self.outputs = run.outputs
        self.pass_rates.append(run.num_tokens / run.seconds)
        self._add_counts(run)

    def _add_counts(self, run: ModeResult) -> None:
        self.num_tokens += run.num_tokens
        self.seconds += run.seconds
        self.acceptance_lengths += run.acceptance_lengths
        self.budgets += run.budgets
        self.num_ngram_tokens += run.num_ngram_tokens
        self.timings = {k: self.timings.get(k, 0) + v for k, v in run.timings.items()}

    @property
    def tau(self) -> float | None:
        a = self.acceptance_lengths
        return sum(a) / len(a) if a else None


def print_concurrency_table(by_key: dict[tuple[int, str], ModeResult], label: str = "T=0") -> None:
    """One row per concurrency and mode: off, auto, dflash and the fastest fixed B of that concurrency."""
    print("| concurrency | mode | tokens/s | x off | drafted | tokens/round | tau |")
    print("|---|---|---|---|---|---|---|")
    same = []
    for c in sorted({c for c, _ in by_key}):
        rows = {name: r for (k, name), r in by_key.items() if k == c}
        off = rows.get("off")
        fixed = [r for name, r in rows.items() if name.startswith("ddtree B=") and "[" not in name]
        shown = [r for r in rows.values() if not r.name.startswith("ddtree B=")]
        if fixed:
            best = max(fixed, key=lambda r: r.tokens_per_second)
            shown.append(best)
        for r in shown:
            rounds = r.timings.get("num_speculative_request_rounds", 0) + r.timings.get(
                "num_autoregressive_request_rounds", 0
            )
            spec = r.timings.get("num_speculative_request_rounds", 0)
            drafted = f"{100 * spec / rounds:.0f}%" if rounds and r.name != "off" and "hf" not in r.name else "-"
            per_round = f"{r.num_tokens / rounds:.2f}" if rounds else "-"
            x_off = f"{r.ratio_to(off):.2f}" if off else "-"
            tau = f"{r.tau:.2f}" if r.tau is not None else "-"
            name = r.name + (" (best B)" if fixed and r is best else "")
            speed = f"{r.tokens_per_second:.1f}"
            if len(r.pass_rates) > 1:
                speed += f" ({min(r.pass_rates):.1f}-{max(r.pass_rates):.1f})"
            print(f"| {c} | {name} | {speed} | {x_off} | {drafted} | {per_round} | {tau} |")
            if (
                off
                and r is not off
                and r.outputs
                and "hf" not in r.name
                and (r.outputs != off.outputs or r.outputs_vary)
            ):
                same.append(f"{r.name} at {c}")
    verdict = "all modes, every concurrency" if not same else "NOT for " + ", ".join(same)
    print(f"\n{label} outputs identical to `off`: {verdict}")


def save_concurrency(by_key: dict[tuple[int, str], ModeResult], args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [
        {
            "concurrency": c,
            "mode": r.name,
            "tokens_per_second": r.tokens_per_second,
            "x_off": r.ratio_to(by_key[c, "off"]) if (c, "off") in by_key else None,
            "tau": r.tau,
            "num_tokens": r.num_tokens,
            "timings": r.timings,
            "tokens_per_second_per_pass": r.pass_rates or None,
        }
        for (c, _), r in sorted(by_key.items(), key=lambda kv: kv[0])
    ]
    (out / "results.json").write_text(json.dumps(rows, indent=2))


def print_table(results: list[ModeResult], label: str = "T=0") -> None:
    by_name = {r.name: r for r in results}
    off = by_name.get("off")
    hf = by_name.get("hf generate")
    header = (
        "| mode | tokens/s | x off | x HF | tau | nodes/draft | drafted | n-gram tokens | draft ms/round "
        "| tree ms/round | verify ms/round | accept ms/round |"
    )
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    for r in results:
        rounds = max(r.timings.get("num_rounds", 0), 1)

        def ms(k: str, r=r, rounds=rounds) -> str:
            return f"{1000 * r.timings[k] / rounds:.1f}" if k in r.timings else "-"

        x_off = f"{r.ratio_to(off):.2f}" if off else "-"
        x_hf = f"{r.ratio_to(hf):.2f}" if hf else "-"
        tau = f"{r.tau:.2f}" if r.tau is not None else "-"
        nodes = f"{sum(r.budgets) / len(r.budgets):.1f}" if r.budgets else "-"
        spec = r.timings.get("num_speculative_request_rounds", 0)
        request_rounds = spec + r.timings.get("num_autoregressive_request_rounds", 0)
        drafted = f"{100 * spec / request_rounds:.0f}%" if request_rounds and r.name != "off" else "-"
        ngram = f"{100 * r.num_ngram_tokens / r.num_tokens:.0f}%" if r.num_ngram_tokens else "-"
        speed = f"{r.tokens_per_second:.1f}"
        if len(r.pass_rates) > 1:
            speed += f" ({min(r.pass_rates):.1f}-{max(r.pass_rates):.1f})"
        print(
            f"| {r.name} | {speed} | {x_off} | {x_hf} | {tau} | {nodes} | {drafted} | {ngram} | {ms('draft')} | "
            f"{ms('tree')} | {ms('verify')} | {ms('accept')} |"
        )
    if off:
        same = [
            r.name for r in results if r.outputs and r.name != "off" and (r.outputs != off.outputs or r.outputs_vary)
        ]
        print(f"\n{label} outputs identical to `off`: {'all modes' if not same else 'NOT for ' + ', '.join(same)}")


def save(results: list[ModeResult], args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    off = next((r for r in results if r.name == "off"), None)
    rows = [
        {
            "mode": r.name,
            "tokens_per_second": r.tokens_per_second,
            "x_off": r.ratio_to(off) if off else None,
            "tau": r.tau,
            "num_tokens": r.num_tokens,
            "mean_nodes_per_draft": sum(r.budgets) / len(r.budgets) if r.budgets else None,
            "num_ngram_tokens": r.num_ngram_tokens,
            "seconds": r.seconds,
            "timings": r.timings,
            "tokens_per_second_per_pass": r.pass_rates or None,
        }
        for r in results
    ]
    (out / "results.json").write_text(json.dumps(rows, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fixed = [r for r in results if r.name.startswith("ddtree B=") and "[" not in r.name]  # the first drafter's
    if not fixed:
        return
    fixed.sort(key=lambda r: int(r.name.split("=")[1]))
    budgets = [int(r.name.split("=")[1]) for r in fixed]
    fig, ax1 = plt.subplots(figsize=(6, 4))
    ax1.plot(budgets, [r.tau or 0 for r in fixed], "o-", label="tau (ddtree)")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("node budget B")
    ax1.set_ylabel("mean acceptance length tau")
    ax2 = ax1.twinx()
    ax2.plot(budgets, [r.tokens_per_second for r in fixed], "s--", color="tab:red", label="tokens/s (ddtree)")
    ax2.set_ylabel("tokens/s")
    for r, style in ((r, ":") for r in results if r.name in ("off", "dflash", "hf generate", "ddtree auto")):
        ax2.axhline(r.tokens_per_second, linestyle=style, color="gray")
        ax2.annotate(r.name, (budgets[0], r.tokens_per_second), fontsize=8)
    fig.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(out / "bench.png", dpi=120)
    print(f"plot: {out / 'bench.png'}")
