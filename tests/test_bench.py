"""`ddtree bench` end to end on tiny float64 models: every mode, several passes in turn, one table and results.json."""

import json

import pytest

from ddtree import bench
from ddtree.bench_report import ModeResult, paired_ratio
from ddtree.cli import main
from tests.factories import make_tiny_drafter, make_tiny_target


def test_bench_runs_every_mode_over_several_passes(tmp_path, capsys):
    target = make_tiny_target(tmp_path / "target", logit_scale=8.0)
    drafter = make_tiny_drafter(tmp_path / "drafter", target)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["hello world", "the cat sat on"]))
    out = tmp_path / "out"
    assert (
        main(
            [
                "bench",
                "--model",
                str(target),
                "--drafter",
                str(drafter),
                "--dtype",
                "float64",
                "--prompts",
                str(prompts),
                "--num-prompts",
                "0",
                "--max-tokens",
                "6",
                "--budgets",
                "2,4",
                "--modes",
                "hf,off,dflash,ddtree,auto",
                "--passes",
                "2",
                "--threads",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "pass 2 of 2" in printed and "T=0 outputs identical to `off`: all modes" in printed
    rows = {r["mode"]: r for r in json.loads((out / "results.json").read_text())}
    assert set(rows) == {"hf generate", "off", "dflash", "ddtree B=2", "ddtree B=4", "ddtree auto"}
    for row in rows.values():
        assert len(row["tokens_per_second_per_pass"]) == 2 and row["num_tokens"] == 2 * 2 * 6
        rates = sorted(row["tokens_per_second_per_pass"])
        assert rates[0] <= row["tokens_per_second"] <= rates[1]  # the median of the passes
    assert rows["ddtree B=4"]["tau"] >= 1.0 and rows["off"]["tau"] is None
    assert rows["ddtree B=2"]["mean_nodes_per_draft"] <= 2 and rows["off"]["mean_nodes_per_draft"] is None
    assert "| nodes/draft | drafted |" in printed


def test_bench_sweeps_concurrency_in_one_table(tmp_path, capsys):
    """--concurrency 1,3: every mode at each count on the same engines, one table with a row per count and mode
    (off, auto, auto without its loop, dflash and the fastest fixed B of that count), results.json naming the count
    of each row."""
    target = make_tiny_target(tmp_path / "target", logit_scale=8.0)
    drafter = make_tiny_drafter(tmp_path / "drafter", target)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["hello world", "the cat sat on", "a"]))
    out = tmp_path / "out"
    assert (
        main(
            [
                "bench",
                "--model",
                str(target),
                "--drafter",
                str(drafter),
                "--dtype",
                "float64",
                "--prompts",
                str(prompts),
                "--num-prompts",
                "0",
                "--max-tokens",
                "6",
                "--budgets",
                "2,4",
                "--modes",
                "off,dflash,ddtree,auto,auto-no-loop,auto-open",
                "--concurrency",
                "1,3",
                "--threads",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "| concurrency | mode | tokens/s | x off | drafted | tokens/round | tau |" in printed
    table = [line for line in printed.splitlines() if line.startswith("| 1 |") or line.startswith("| 3 |")]
    assert len(table) == 2 * 6  # off, dflash, auto, auto without its loop, auto in open batches, best B: at each
    assert sum("(best B)" in line for line in table) == 2
    assert "T=0 outputs identical to `off`: all modes, every concurrency" in printed
    rows = json.loads((out / "results.json").read_text())
    assert {(r["concurrency"], r["mode"]) for r in rows} == {
        (c, m)
        for c in (1, 3)
        for m in (
            "off",
            "dflash",
            "ddtree B=2",
            "ddtree B=4",
            "ddtree auto",
            "ddtree auto, no loop",
            "ddtree auto, open batch",
        )
    }
    assert all(r["num_tokens"] == 3 * 6 for r in rows)
    assert all(r["x_off"] == 1.0 for r in rows if r["mode"] == "off") and all(r["x_off"] > 0 for r in rows)


def test_bench_samples_seeded_and_checks_every_mode_against_off(tmp_path, capsys):
    """--temperature > 0: the requests are seeded, so every lossless mode gives `off`'s tokens; the check says so
    (and would name a mode that did not). hf generate runs greedy only, so it is skipped."""
    target = make_tiny_target(tmp_path / "target", logit_scale=2.0)
    drafter = make_tiny_drafter(tmp_path / "drafter", target)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["hello world", "the cat sat on", "a"]))
    out = tmp_path / "out"
    common = [
        "bench",
        "--model",
        str(target),
        "--drafter",
        str(drafter),
        "--dtype",
        "float64",
        "--prompts",
        str(prompts),
        "--num-prompts",
        "0",
        "--max-tokens",
        "8",
        "--budgets",
        "4",
        "--threads",
        "1",
        "--out",
        str(out),
        "--concurrency",
        "1,2",
        "--modes",
        "hf,off,dflash,ddtree,auto",
    ]
    assert main(common + ["--temperature", "0.9", "--seed", "3"]) == 0
    printed = capsys.readouterr().out
    assert "T=0.9 seeded outputs identical to `off`: all modes, every concurrency" in printed
    assert "hf generate runs greedy only" in printed
    sampled = {(r["concurrency"], r["mode"]): r for r in json.loads((out / "results.json").read_text())}
    assert (1, "hf generate") not in sampled
    assert main(common + ["--temperature", "0"]) == 0
    greedy = {(r["concurrency"], r["mode"]): r for r in json.loads((out / "results.json").read_text())}
    assert "T=0 outputs identical" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--temperature"):
        main(common + ["--temperature", "-1"])
    assert set(greedy) - set(sampled) == {(1, "hf generate")}


def test_bench_compares_two_drafters_on_one_target(tmp_path, capsys):
    target = make_tiny_target(tmp_path / "target", logit_scale=8.0)
    first = make_tiny_drafter(tmp_path / "first", target)
    second = make_tiny_drafter(tmp_path / "second", target, seed=7, num_layers=2)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello world"}) + "\n")
    out = tmp_path / "out"
    assert (
        main(
            [
                "bench",
                "--model",
                str(target),
                "--drafter",
                str(first),
                "--compare-drafter",
                str(second),
                "--dtype",
                "float64",
                "--prompts",
                str(prompts),
                "--num-prompts",
                "0",
                "--max-tokens",
                "6",
                "--budgets",
                "2",
                "--modes",
                "off,ddtree,auto",
                "--threads",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert "T=0 outputs identical to `off`: all modes" in capsys.readouterr().out
    rows = {r["mode"] for r in json.loads((out / "results.json").read_text())}
    assert rows == {"off", "ddtree B=2", "ddtree B=2 [second]", "ddtree auto", "ddtree auto [second]"}
    other_layers = make_tiny_drafter(tmp_path / "other", target, target_layer_ids=[1])
    with pytest.raises(ValueError, match="features of layers"):
        main(
            [
                "bench",
                "--model",
                str(target),
                "--drafter",
                str(first),
                "--compare-drafter",
                str(other_layers),
                "--dtype",
                "float64",
                "--prompts",
                str(prompts),
                "--modes",
                "off",
                "--out",
                str(out),
            ]
        )


def test_ddtree_generate_streams_with_logprobs_and_bad_input_is_one_line(tmp_path, capsys, monkeypatch):
    """`ddtree generate` on a tiny model: the answer streamed, then each token's log-probability; a bad value is
    `ddtree: error: ...` and exit status 2 before any model loads."""
    import sys

    from ddtree.cli import console_main

    target = make_tiny_target(tmp_path / "target", logit_scale=8.0)
    drafter = make_tiny_drafter(tmp_path / "drafter", target)
    common = [
        "ddtree",
        "generate",
        "hello",
        "--raw",
        "--model",
        str(target),
        "--drafter",
        str(drafter),
        "--dtype",
        "float64",
        "--max-tokens",
        "5",
    ]
    monkeypatch.setattr(sys, "argv", common + ["--logprobs", "2"])
    assert console_main() == 0
    captured = capsys.readouterr()
    assert captured.out.strip() and len([line for line in captured.err.splitlines() if "top:" in line]) == 5
    monkeypatch.setattr(
        sys, "argv", ["ddtree", "generate", "hello", "--model", str(tmp_path / "missing"), "--temperature", "-1"]
    )
    assert console_main() == 2
    assert capsys.readouterr().err.strip().startswith("ddtree: error: --temperature must be")  # the flag's name
    monkeypatch.setattr(sys, "argv", ["ddtree", "generate", "hello", "--logprobs", "25"])
    assert console_main() == 2
    assert capsys.readouterr().err.strip() == "ddtree: error: --logprobs must be an integer in [0, 20], got 25"
    monkeypatch.setattr(sys, "argv", ["ddtree", "generate", "hello", "--budget", "lots"])
    assert console_main() == 2
    assert capsys.readouterr().err.strip() == "ddtree: error: --budget must be 'auto' or an integer, got 'lots'"


def test_ddtree_chat_keeps_the_conversation_and_quits(tmp_path, capsys, monkeypatch):
    """`ddtree chat` on a tiny model: each answer streamed; /reset starts over; /quit ends before the next line."""
    import io
    import sys

    target = make_tiny_target(tmp_path / "target", logit_scale=8.0)
    drafter = make_tiny_drafter(tmp_path / "drafter", target)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\nhi\n/reset\nhi\n/quit\nnever sent\n"))
    assert (
        main(
            [
                "chat",
                "--model",
                str(target),
                "--drafter",
                str(drafter),
                "--dtype",
                "float64",
                "--max-tokens",
                "4",
                "--stats",
                "--temperature",
                "0",
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    stats = [line for line in err.splitlines() if line.startswith("[")]
    assert len(stats) == 3  # three answers: "never sent" was not
    assert err.count("(conversation reset)") == 1


def test_ctrl_c_in_any_command_is_one_line_and_status_130(monkeypatch, capsys):
    import ddtree.cli as cli

    def interrupted(argv=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "main", interrupted)
    assert cli.console_main() == 130
    assert capsys.readouterr().err.strip() == "ddtree: interrupted"


def test_bench_refuses_bad_arguments_and_prompt_files_before_loading(tmp_path):
    """Each bad value names its flag (or the prompt file's line) before any model loads: the model path given does
    not exist, so getting past the checks would fail otherwise."""
    missing = str(tmp_path / "no-model")
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"prompt": "hi"}) + "\n")
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    cases = {
        ("--budgets", "abc"): "--budgets must be integers",
        ("--budgets", "0"): "--budgets must be positive",
        ("--max-tokens", "0"): "--max-tokens must be >= 1",
        ("--concurrency", "0"): "--concurrency must be >= 1",
        ("--concurrency", "1,x"): "--concurrency must be integers separated by commas",
        ("--concurrency", "4,0"): "--concurrency must be >= 1",
        ("--num-prompts", "-1"): "--num-prompts must be >= 0",
        ("--concurrency", "1,2"): "--concurrency 2 needs at least that many prompts, and the run has 1",
        ("--out", str(a_file)): "is a file; it must be a folder",
    }
    for (flag, value), message in cases.items():
        with pytest.raises(ValueError, match=message):
            main(
                ["bench", "--model", missing, "--prompts", str(good), flag, value, "--out", str(tmp_path / "o")]
                if flag != "--out"
                else ["bench", "--model", missing, "--prompts", str(good), flag, value]
            )
    lines = {
        '{"text": "hello"}': "'prompt' must be a non-empty string",
        '"just a string"': "expected an object",
        '{"prompt": 5}': "'prompt' must be a non-empty string",
        "{not json": "not JSON",
        '{"messages": [{"role": "user"}]}': "'messages' must be a non-empty list",
    }
    for line, message in lines.items():
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps({"prompt": "fine"}) + "\n\n" + line + "\n")
        with pytest.raises(ValueError, match=f"bad.jsonl:3: {message}"):
            main(["bench", "--model", missing, "--prompts", str(bad), "--out", str(tmp_path / "o")])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no prompts in the file"):
        main(["bench", "--model", missing, "--prompts", str(empty), "--out", str(tmp_path / "o")])
    with pytest.raises(ValueError, match="--num-prompts must be at least 1"):
        main(["bench", "--model", missing, "--num-prompts", "0", "--out", str(tmp_path / "o")])


def test_bench_without_speculative_modes_needs_no_drafter_and_ctrl_c_keeps_finished_passes(
    tmp_path, capsys, monkeypatch
):
    import ddtree.bench as bench

    target = make_tiny_target(tmp_path / "target", logit_scale=8.0)
    drafter = make_tiny_drafter(tmp_path / "drafter", target)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello world"}) + "\n")
    out = tmp_path / "out"
    common = [
        "bench",
        "--model",
        str(target),
        "--dtype",
        "float64",
        "--prompts",
        str(prompts),
        "--max-tokens",
        "4",
        "--threads",
        "1",
        "--out",
        str(out),
    ]
    assert main(common + ["--modes", "off"]) == 0  # a custom target, no --drafter: fine without speculation
    real_run_engine, calls = bench.run_engine, []

    def interrupted_at_the_fifth(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real_run_engine(*args, **kwargs)

    monkeypatch.setattr(bench, "run_engine", interrupted_at_the_fifth)
    with pytest.raises(KeyboardInterrupt):
        main(common + ["--drafter", str(drafter), "--modes", "off,ddtree", "--budgets", "4,2,4", "--passes", "2"])
    printed = capsys.readouterr().out
    assert "interrupted in pass 2 of 2" in printed
    rows = {r["mode"]: r for r in json.loads((out / "results.json").read_text())}
    # the first pass, whole (budgets distinct, in increasing order); of the second, two runs of three: not kept, so
    # that every mode's passes pair with off's
    assert list(rows) == ["off", "ddtree B=2", "ddtree B=4"]
    assert all(len(r["tokens_per_second_per_pass"]) == 1 for r in rows.values())


def test_generate_reads_stdin_and_stops_and_chat_survives_a_bad_turn(tmp_path, capsys, monkeypatch):
    """`ddtree generate -` reads the prompt from standard input; --stop ends the answer before the string. In
    `ddtree chat`, a message that cannot be answered (longer than the context window) is dropped with one line,
    and the conversation goes on; empty lines are skipped; --system starts the conversation."""
    import io
    import sys

    from ddtree.llm import LLM
    from ddtree.sampling_params import SamplingParams

    target = make_tiny_target(tmp_path / "target", logit_scale=8.0)
    drafter = make_tiny_drafter(tmp_path / "drafter", target)
    model = ["--model", str(target), "--drafter", str(drafter), "--dtype", "float64"]
    reference = (
        LLM(str(target), str(drafter), dtype="float64", speculation="off")
        .generate("hello", SamplingParams(max_tokens=12, temperature=0))[0]
        .text
    )
    stop = reference[3:5]
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello"))
    assert main(["generate", "-", "--raw", "--max-tokens", "12", "--stop", stop] + model) == 0
    answer = capsys.readouterr().out.rstrip("\n")
    assert answer == reference[: reference.index(stop)]
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n\n" + "long " * 400 + "\nhi again\n/quit\n"))
    assert main(["chat", "--max-tokens", "3", "--stats", "--system", "be brief"] + model) == 0
    err = capsys.readouterr().err
    assert "this message is dropped" in err
    assert len([line for line in err.splitlines() if line.startswith("[")]) == 2  # both short messages answered


def test_an_unusable_device_is_refused_before_anything_loads(tmp_path):
    import torch

    from ddtree.loaders import build_workers

    missing = str(tmp_path / "no-model")
    with pytest.raises(ValueError, match="'tpu' is not a torch device"):
        build_workers(missing, device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available here"):
            build_workers(missing, device="cuda")


def test_a_closed_output_pipe_ends_quietly(monkeypatch, capsys):
    import ddtree.cli as cli

    def reader_went_away(argv=None):
        raise BrokenPipeError

    monkeypatch.setattr(cli, "main", reader_went_away)
    assert cli.console_main() == 1
    assert capsys.readouterr().err == ""


def load_benchmark(name: str):
    """A script of benchmarks/ as a module (the folder is no package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_target_instances_refuses_bad_arguments_clearly(capsys):
    module = load_benchmark("bench_target_instances")
    args = module.parse([])
    assert (args.concurrency, args.temperature, args.passes, args.num_prompts) == (8, 1.0, 4, 11)
    for bad, says in ((["--concurrency", "40"], "needs at least that many prompts"), (["--passes", "0"], ">= 1")):
        with pytest.raises(SystemExit):
            module.parse(bad)
        assert says in capsys.readouterr().err


def test_bench_serving_modes_are_valid_app_args_and_unknown_ones_are_refused():
    """Every mode of benchmarks/bench_serving.py is a valid set of app args (checked by the app's own validation,
    as `build_app` checks them), and an unknown mode is refused with the list of modes. In a subprocess: the
    script sets the workers' environment (OpenMP, memory pages) for its in-process engine when it is imported."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    check = (
        "import sys; sys.path.insert(0, 'benchmarks'); import bench_serving as b; "
        "from deployments.config import parse_args; "
        "print(sorted(m for m in b.MODES if parse_args(dict(b.MODES[m]))))"
    )
    done = subprocess.run([sys.executable, "-c", check], cwd=repo, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "'auto-no-loop'" in done.stdout and "'auto-no-ngram'" in done.stdout
    bad = subprocess.run(
        [sys.executable, "benchmarks/bench_serving.py", "--modes", "off,fast"],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "unknown fast; choose from off, auto, dflash, auto-no-ngram" in bad.stderr


def test_every_other_pass_runs_the_modes_last_to_first_and_records_whole_passes(monkeypatch):
    """A pass runs each group on every engine in turn, the odd passes in reverse order, so a drift within a group's
    turns favours no mode; each engine's pass is recorded once, after the pass, in the engines' order."""
    turns = []

    def fake_run_engine(engine, prompts, params, name):
        turns.append((name, len(prompts)))
        return ModeResult(name, num_tokens=len(prompts), seconds=1.0)

    monkeypatch.setattr(bench, "run_engine", fake_run_engine)
    engines = [("off", None), ("ddtree auto", None)]
    recorded = []
    for p in range(2):
        bench.run_pass(engines, [[1]] * 3, None, 2, recorded.append, reverse=p % 2 == 1)
    assert turns == [
        ("off", 2), ("ddtree auto", 2), ("off", 1), ("ddtree auto", 1),
        ("ddtree auto", 2), ("off", 2), ("ddtree auto", 1), ("off", 1),
    ]  # fmt: skip
    assert [(r.name, r.num_tokens) for r in recorded] == [("off", 3), ("ddtree auto", 3)] * 2


def test_a_modes_ratio_to_off_is_the_median_of_its_passes_ratios():
    """Each pass ran the modes side by side: the ratio pairs them, so a machine that drifts between passes (here
    100, 120, 80 tok/s for `off`) does not move it; with unequal pass counts it falls back to the medians."""
    off, auto = ModeResult("off"), ModeResult("ddtree auto")
    off.pass_rates, auto.pass_rates = [100.0, 120.0, 80.0], [99.0, 123.6, 79.2]  # 0.99, 1.03, 0.99 of each pass
    assert auto.ratio_to(off) == pytest.approx(0.99)
    assert auto.tokens_per_second / off.tokens_per_second == pytest.approx(0.99)  # (medians: 99 over 100)
    auto.pass_rates = [99.0, 123.6, 96.0]  # 0.99, 1.03, 1.20
    assert auto.ratio_to(off) == pytest.approx(1.03)
    assert auto.tokens_per_second / off.tokens_per_second == pytest.approx(0.99)  # the medians pair 99 with 100
    auto.pass_rates = [110.0]
    assert auto.ratio_to(off) == pytest.approx(1.10)  # one pass against three: the medians
    assert off.ratio_to(off) == 1.0
    # benchmarks/bench_serving.py's ratios (served x off, served / offline, steady) take the same rule
    assert paired_ratio([99.0, 123.6, 96.0], [100.0, 120.0, 80.0]) == pytest.approx(1.03)
    assert paired_ratio([99.0, 123.6], [100.0, 120.0, 80.0]) == pytest.approx(111.3 / 100.0)
    assert paired_ratio([], [100.0]) == 0.0 and paired_ratio([1.0], []) == 0.0


def test_bench_spread_rows_lays_the_same_rows_out_over_more_requests(capsys):
    module = load_benchmark("bench_spread_rows")
    layouts = module.layouts(16, 8)
    assert list(layouts) == [f"8 rows in {k} request{'s' if k > 1 else ''}" for k in (1, 2, 4, 8)]
    for name, lengths in layouts.items():
        holders = int(name.split(" in ")[1].split()[0])
        assert len(lengths) == 16 and sum(lengths) == 8 and sum(1 for n in lengths if n) == holders
    assert list(module.layouts(4, 6)) == ["6 rows in 1 request", "6 rows in 2 requests"]  # 6 / 4 is no whole chain
    with pytest.raises(SystemExit):
        module.parse(["--extra", "0"])
    assert ">= 1" in capsys.readouterr().err
