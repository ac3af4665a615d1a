"""`ddtree bench` end to end on tiny float64 models: every mode, several passes in turn, one table and results.json."""

import json

import pytest

from ddtree.cli import main
from tests.factories import make_tiny_drafter, make_tiny_target


def test_bench_runs_every_mode_over_several_passes(tmp_path, capsys):
    target = make_tiny_target(tmp_path / "target", logit_scale=8.0)
    drafter = make_tiny_drafter(tmp_path / "drafter", target)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["hello world", "the cat sat on"]))
    out = tmp_path / "out"
    assert main(["bench", "--model", str(target), "--drafter", str(drafter), "--dtype", "float64",
                 "--prompts", str(prompts), "--num-prompts", "0", "--max-tokens", "6", "--budgets", "2,4",
                 "--modes", "hf,off,dflash,ddtree,auto", "--passes", "2", "--threads", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "done: pass 2 of 2" in printed and "T=0 outputs identical to `off`: all modes" in printed
    rows = {r["mode"]: r for r in json.loads((out / "results.json").read_text())}
    assert set(rows) == {"hf generate", "off", "dflash", "ddtree B=2", "ddtree B=4", "ddtree auto"}
    for row in rows.values():
        assert len(row["tokens_per_second_per_pass"]) == 2 and row["num_tokens"] == 2 * 2 * 6
        rates = sorted(row["tokens_per_second_per_pass"])
        assert rates[0] <= row["tokens_per_second"] <= rates[1]  # the median of the passes
    assert rows["ddtree B=4"]["tau"] >= 1.0 and rows["off"]["tau"] is None
    assert rows["ddtree B=2"]["mean_nodes_per_draft"] <= 2 and rows["off"]["mean_nodes_per_draft"] is None
    assert "| nodes/draft | drafted |" in printed


def test_bench_compares_two_drafters_on_one_target(tmp_path, capsys):
    target = make_tiny_target(tmp_path / "target", logit_scale=8.0)
    first = make_tiny_drafter(tmp_path / "first", target)
    second = make_tiny_drafter(tmp_path / "second", target, seed=7, num_layers=2)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello world"}) + "\n")
    out = tmp_path / "out"
    assert main(["bench", "--model", str(target), "--drafter", str(first), "--compare-drafter", str(second),
                 "--dtype", "float64", "--prompts", str(prompts), "--num-prompts", "0", "--max-tokens", "6",
                 "--budgets", "2", "--modes", "off,ddtree,auto", "--threads", "1", "--out", str(out)]) == 0
    assert "T=0 outputs identical to `off`: all modes" in capsys.readouterr().out
    rows = {r["mode"] for r in json.loads((out / "results.json").read_text())}
    assert rows == {"off", "ddtree B=2", "ddtree B=2 [second]", "ddtree auto", "ddtree auto [second]"}
    other_layers = make_tiny_drafter(tmp_path / "other", target, target_layer_ids=[1])
    with pytest.raises(ValueError, match="features of layers"):
        main(["bench", "--model", str(target), "--drafter", str(first), "--compare-drafter", str(other_layers),
              "--dtype", "float64", "--prompts", str(prompts), "--modes", "off", "--out", str(out)])


def test_ddtree_generate_streams_with_logprobs_and_bad_input_is_one_line(tmp_path, capsys, monkeypatch):
    """`ddtree generate` on a tiny model: the answer streamed, then each token's log-probability; a bad value is
    `ddtree: error: ...` and exit status 2 before any model loads."""
    import sys

    from ddtree.cli import console_main

    target = make_tiny_target(tmp_path / "target", logit_scale=8.0)
    drafter = make_tiny_drafter(tmp_path / "drafter", target)
    common = ["ddtree", "generate", "hello", "--raw", "--model", str(target), "--drafter", str(drafter),
              "--dtype", "float64", "--max-tokens", "5"]
    monkeypatch.setattr(sys, "argv", common + ["--logprobs", "2"])
    assert console_main() == 0
    captured = capsys.readouterr()
    assert captured.out.strip() and len([line for line in captured.err.splitlines() if "top:" in line]) == 5
    monkeypatch.setattr(sys, "argv", ["ddtree", "generate", "hello", "--model", str(tmp_path / "missing"),
                                      "--temperature", "-1"])
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
    assert main(["chat", "--model", str(target), "--drafter", str(drafter), "--dtype", "float64",
                 "--max-tokens", "4", "--stats", "--temperature", "0"]) == 0
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
