"""The whole `ddtree train-drafter` pipeline on a tiny random Llama target with a character tokenizer: it works for
any Llama-family folder, both generation engines agree, and training/evaluation produce a DFlash checkpoint."""

import importlib.util
import json
import math
import random

import pytest
import torch
from safetensors.torch import load_file

from ddtree.cli import main
from ddtree.models import default as default_model
from ddtree.models.dflash import load_dflash
from ddtree.training.generate import (
    append_jsonl,
    generate_responses,
    generate_responses_continuous,
    interleave_pending,
    read_jsonl,
    write_prompts,
)
from ddtree.training.prompts import Prompt
from ddtree.training.train import weights_sha256


def test_runner_and_hf_generation_give_the_same_tokens_and_features(tiny_target, tmp_path):
    prompts = [
        Prompt(f"p{i}", "chat", text, "test")
        for i, text in enumerate(
            [
                "hello there",
                "what is 2 and 3?",
                "a much longer prompt, to make the padding matter.",
                "a prompt past the runner's 512-token sizing of its KV pool: kept whole, as by hf. " * 8,
            ]
        )
    ]
    for name in ("runner", "hf"):
        write_prompts(tmp_path / name, prompts)
    layers = (0, 2)
    n_runner = generate_responses_continuous(
        tmp_path / "runner", str(tiny_target), batch_size=2, max_new_tokens=9, stored_layer_ids=layers
    )
    n_hf = generate_responses(
        tmp_path / "hf", str(tiny_target), batch_size=3, max_new_tokens=9, stored_layer_ids=layers
    )
    assert n_runner == n_hf == 4
    by_engine = {}
    for name in ("runner", "hf"):
        records = [json.loads(line) for line in (tmp_path / name / "responses.jsonl").read_text().splitlines()]
        by_engine[name] = {
            r["prompt_id"]: (r, load_file(str(tmp_path / name / "features" / r["shard"]))[r["prompt_id"]])
            for r in records
        }
    for prompt_id, (r, features) in by_engine["runner"].items():
        r_hf, features_hf = by_engine["hf"][prompt_id]
        assert r["prompt_ids"] == r_hf["prompt_ids"] and r["response_ids"] == r_hf["response_ids"]
        assert features.shape == (len(r["prompt_ids"]) + len(r["response_ids"]) - 1, len(layers), 64)
        torch.testing.assert_close(features.float(), features_hf.float(), rtol=0.02, atol=0.02)


def test_soft_targets_are_the_targets_top_k_at_each_response_token_and_train(tiny_target, tmp_path):
    """Both engines store, per response token, the target's top-k log-probabilities there: the greedy token first,
    and the values of a forward over the whole sequence. Training takes them with --soft-target-weight, and refuses
    it on data made without them; a data directory keeps one k."""
    from ddtree.training.generate import soft_target_keys
    from ddtree.training.target import load_target

    prompts = [Prompt(f"p{i}", "chat", text, "test") for i, text in enumerate(["hello there", "what is 2 and 3?"])]
    for name in ("runner", "hf"):
        write_prompts(tmp_path / name, prompts)
    generate_responses_continuous(
        tmp_path / "runner",
        str(tiny_target),
        batch_size=2,
        max_new_tokens=7,
        stored_layer_ids=(0, 2),
        soft_target_top_k=5,
    )
    generate_responses(
        tmp_path / "hf", str(tiny_target), batch_size=2, max_new_tokens=7, stored_layer_ids=(0, 2), soft_target_top_k=5
    )
    model, _ = load_target(str(tiny_target), dtype=torch.float32)
    for name in ("runner", "hf"):
        for r in read_jsonl(tmp_path / name / "responses.jsonl"):
            shard = load_file(str(tmp_path / name / "features" / r["shard"]))
            ids_key, logprobs_key = soft_target_keys(r["prompt_id"])
            ids, logprobs = shard[ids_key], shard[logprobs_key]
            num_prompt, response = len(r["prompt_ids"]), r["response_ids"]
            assert ids.shape == logprobs.shape == (len(response), 5) and ids.dtype == torch.int32
            assert ids[:, 0].tolist() == response  # greedy: the most likely token is the one generated
            with torch.no_grad():
                logits = model(torch.tensor([r["prompt_ids"] + response])).logits[0, num_prompt - 1 : -1]
            want_logprobs, want_ids = torch.log_softmax(logits.float(), -1).topk(5)
            torch.testing.assert_close(logprobs.float(), want_logprobs, rtol=0, atol=2e-3)  # (float16)
            assert ids.long().tolist() == want_ids.tolist()
    common = ["train-drafter", "--target", str(tiny_target), "--num-threads", "1"]
    shape = ["--num-draft-layers", "1", "--block-size", "4", "--target-layer-ids", "0", "2", "--mask-token-id", "1"]
    short = ["--max-new-tokens", "6", "--batch-size", "4", "--stored-layer-ids", "0", "1", "2"]
    with_soft, without = tmp_path / "with", tmp_path / "without"
    for data_dir, top_k in ((with_soft, "4"), (without, "0")):
        prompts_args = ["--num-prompts-per-category", "2", "--categories", "chat", "math"]
        assert (
            main(
                [
                    *common,
                    "prompts",
                    "generate",
                    "--data-dir",
                    str(data_dir),
                    *prompts_args,
                    *short,
                    "--soft-target-top-k",
                    top_k,
                ]
            )
            == 0
        )
    assert json.loads((with_soft / "manifest.json").read_text())["soft_target_top_k"] == 4
    # each labelled block position gets the target's top-k at its own token: the greedy token first is the label
    from ddtree.models.dflash import DFlashConfig
    from ddtree.training.data import DataSetReader, read_sequences
    from ddtree.training.train import make_batch

    config = DFlashConfig(
        hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
        head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=model.config.vocab_size,
        max_position_embeddings=256, block_size=4, num_target_layers=3, mask_token_id=1, target_layer_ids=[0, 2],
    )  # fmt: skip
    sequences = read_sequences(with_soft)
    reader = DataSetReader([with_soft], [0, 2])
    _, batch, (top_ids, top_logprobs) = make_batch(sequences, reader, config, 5, random.Random(0), None, True)
    labels = batch.labels.reshape(-1)[batch.labelled_rows]
    assert top_ids.shape == top_logprobs.shape == (labels.numel(), 4) and labels.numel() > 8
    assert top_ids[:, 0].tolist() == labels.tolist()
    assert bool((top_logprobs[:, :-1] >= top_logprobs[:, 1:]).all())
    with pytest.raises(ValueError, match="holds responses with 4 soft targets per token"):
        main([*common, "generate", "--data-dir", str(with_soft), *short, "--soft-target-top-k", "8"])
    train = [*common, "train", *shape, "--max-steps", "2", "--train-batch-size", "2", "--num-negatives", "8"]
    with pytest.raises(ValueError, match="holds no soft targets"):
        main([*train, "--data-dir", str(without), "--out-dir", str(tmp_path / "o1"), "--soft-target-weight", "0.5"])
    assert (
        main(
            [
                *train,
                "--data-dir",
                str(with_soft),
                "--out-dir",
                str(tmp_path / "o2"),
                "--soft-target-weight",
                "0.5",
                "--gamma",
                "1.5",
            ]
        )
        == 0
    )
    config = json.loads((tmp_path / "o2" / "manifest.json").read_text())["train_config"]
    assert config["soft_target_weight"] == 0.5 and config["gamma"] == 1.5
    log = [json.loads(line) for line in (tmp_path / "o2" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2] and all(math.isfinite(r["loss"]) for r in log)
    # data sets made apart train together (and make one draft vocabulary): each read from its own shards
    both = ["--data-dir", str(with_soft), "--extra-data-dirs", str(without), "--out-dir", str(tmp_path / "o3")]
    with pytest.raises(ValueError, match="named twice"):
        main([*train, "--data-dir", str(with_soft), "--extra-data-dirs", str(with_soft), "--out-dir", str(tmp_path)])
    with pytest.raises(ValueError, match="holds no soft targets"):
        main([*train, *both, "--soft-target-weight", "0.5"])
    train_vocab = [*common, "train", "vocab", *train[len(common) + 1 :]]
    assert main([*train_vocab, *both, "--train-batch-size", "8"]) == 0  # one batch: every sequence
    manifest = json.loads((tmp_path / "o3" / "manifest.json").read_text())
    assert manifest["train_data_dirs"] == [str(with_soft), str(without)]
    log = [json.loads(line) for line in (tmp_path / "o3" / "log.jsonl").read_text().splitlines()]
    num_sequences = sum(len(read_jsonl(d / "responses.jsonl")) for d in (with_soft, without))
    assert log[0]["num_sequences"] == num_sequences == 8
    vocab = json.loads((tmp_path / "o3" / "drafter" / "draft_vocab.json").read_text())
    assert vocab["data_dirs"] == [str(with_soft), str(without)] and vocab["num_responses"] == 8


def test_runner_generation_stops_on_time_and_resumes(tiny_target, tmp_path):
    prompts = [Prompt(f"p{i}", "math", f"what is {i} and {i}?", "test") for i in range(5)]
    write_prompts(tmp_path, prompts)
    # out of time at once: nothing admitted, and it returns (it once spun forever with prompts still queued)
    assert (
        generate_responses_continuous(
            tmp_path, str(tiny_target), batch_size=2, max_new_tokens=4, stored_layer_ids=(1,), max_seconds=0.0
        )
        == 0
    )
    assert (
        generate_responses_continuous(
            tmp_path,
            str(tiny_target),
            batch_size=2,
            max_new_tokens=4,
            stored_layer_ids=(1,),
            max_prompts=2,
            shard_size=1,
        )
        == 2
    )
    assert (
        generate_responses_continuous(tmp_path, str(tiny_target), batch_size=2, max_new_tokens=4, stored_layer_ids=(1,))
        == 3
    )
    ids = [json.loads(line)["prompt_id"] for line in (tmp_path / "responses.jsonl").read_text().splitlines()]
    assert sorted(ids) == [f"p{i}" for i in range(5)]


def test_cli_pipeline_end_to_end_on_a_tiny_target(tiny_target, tmp_path):
    common = [
        "train-drafter",
        "--target",
        str(tiny_target),
        "--data-dir",
        str(tmp_path / "data"),
        "--eval-dir",
        str(tmp_path / "eval"),
        "--out-dir",
        str(tmp_path / "out"),
        "--num-threads",
        "1",
    ]
    assert (
        main(
            common[:1]
            + ["prompts", "generate", "eval-data"]
            + common[1:]
            + [
                "--num-prompts-per-category",
                "3",
                "--max-new-tokens",
                "6",
                "--batch-size",
                "4",
                "--num-eval-prompts",
                "2",
                "--stored-layer-ids",
                "0",
                "1",
                "2",
            ]
        )
        == 0
    )
    with pytest.raises(ValueError, match="holds features of the layers"):  # shards are read with one layout
        main(common[:1] + ["generate"] + common[1:] + ["--stored-layer-ids", "0", "1", "3"])
    with pytest.raises(ValueError, match="fewer than one batch"):
        main(
            common[:1]
            + ["train"]
            + common[1:]
            + [
                "--num-draft-layers",
                "1",
                "--target-layer-ids",
                "0",
                "2",
                "--mask-token-id",
                "1",
                "--train-batch-size",
                "64",
            ]
        )
    assert (
        main(
            common[:1]
            + ["train", "vocab", "eval"]
            + common[1:]
            + [
                "--num-draft-layers",
                "1",
                "--block-size",
                "4",
                "--target-layer-ids",
                "0",
                "2",
                "--mask-token-id",
                "1",
                "--max-steps",
                "3",
                "--train-batch-size",
                "2",
                "--max-anchors",
                "3",
                "--budgets",
                "2",
                "4",
                "--num-negatives",
                "8",
                "--draft-vocab-size",
                "5",
            ]
        )
        == 0
    )
    config, drafter = load_dflash(tmp_path / "out" / "drafter")
    assert config.block_size == 4 and config.target_layer_ids == [0, 2] and config.hidden_size == 64
    tau = json.loads((tmp_path / "out" / "drafter" / "tau.json").read_text())
    vocab = json.loads((tmp_path / "out" / "drafter" / "draft_vocab.json").read_text())
    assert 5 <= len(vocab["token_ids"]) <= 6 and vocab["num_tokens"] == len(vocab["token_ids"])  # + EOS
    assert tau["draft_vocab_size"] == len(vocab["token_ids"])  # evaluated over what serving drafts over
    assert [r["category"] for r in tau["results"]] == ["code", "math", "chat"]
    assert all(1.0 <= r["tau_chain"] <= r["tau_tree_B4"] + 1e-9 for r in tau["results"])
    log = [json.loads(line) for line in (tmp_path / "out" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3]
    # resuming with a larger budget continues from step 3 (a log line cut by a crash is dropped)
    with open(tmp_path / "out" / "log.jsonl", "a") as f:
        f.write('{"step": 3, "epo')
    assert (
        main(
            common[:1]
            + ["train"]
            + common[1:]
            + [
                "--num-draft-layers",
                "1",
                "--block-size",
                "4",
                "--target-layer-ids",
                "0",
                "2",
                "--mask-token-id",
                "1",
                "--max-steps",
                "4",
                "--train-batch-size",
                "2",
                "--max-anchors",
                "3",
                "--num-negatives",
                "8",
            ]
        )
        == 0
    )
    log = [json.loads(line) for line in (tmp_path / "out" / "log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == 4
    # ship: only with a tau measured on these weights (training went on since the eval) and over this vocabulary
    ship = common[:1] + ["ship"] + common[1:] + ["--ship-dir", str(tmp_path / "ship")]
    with pytest.raises(ValueError, match="other weights"):
        main(ship)
    assert not (tmp_path / "ship").exists()  # checked before anything is copied
    with pytest.raises(ValueError, match="--ship-dir is needed"):  # not into the embedded drafter's folder
        main(common[:1] + ["ship"] + common[1:])
    assert main(common[:1] + ["eval"] + common[1:] + ["--budgets", "2", "4"]) == 0
    assert main(ship) == 0
    shipped = json.loads((tmp_path / "ship" / "MANIFEST.json").read_text())
    assert shipped["training_steps"] == 4 and shipped["tau"]["weights_sha256"]
    assert [r["engine"] for r in shipped["data"]["generate_runs"]] == ["runner"]
    assert json.loads((tmp_path / "ship" / "draft_vocab.json").read_text()) == vocab
    assert shipped["draft_vocab"] == {k: v for k, v in vocab.items() if k != "token_ids"}  # its own provenance
    assert shipped["draft_vocab"]["num_tokens"] == len(vocab["token_ids"]) and shipped["draft_vocab"]["data_dirs"]
    assert main(common[:1] + ["vocab"] + common[1:] + ["--draft-vocab-size", "3"]) == 0  # tau.json is now stale
    with pytest.raises(ValueError, match="draft vocabulary"):
        main(ship)
    assert json.loads((tmp_path / "ship" / "draft_vocab.json").read_text()) == vocab  # nothing was half-shipped
    assert main(common[:1] + ["eval"] + common[1:] + ["--budgets", "2", "4"]) == 0
    assert main(ship) == 0
    assert len(json.loads((tmp_path / "ship" / "draft_vocab.json").read_text())["token_ids"]) <= 4
    assert shipped["init_from"] is None  # trained from scratch
    # a fine-tune of the shipped drafter, shipped over it, keeps its parent's manifest and weights' hash
    parent = json.loads((tmp_path / "ship" / "MANIFEST.json").read_text())
    parent_weights = weights_sha256(tmp_path / "ship")
    fine_tune = [a if a != str(tmp_path / "out") else str(tmp_path / "out2") for a in common]
    init = ["--init-from", str(tmp_path / "ship"), "--max-steps", "1", "--train-batch-size", "2"]
    shape = ["--num-draft-layers", "1", "--block-size", "4", "--target-layer-ids", "0", "2", "--mask-token-id", "1"]
    tiny = ["--max-anchors", "3", "--num-negatives", "8", "--budgets", "2"]
    assert main(fine_tune[:1] + ["train", "vocab", "eval"] + fine_tune[1:] + init + shape + tiny) == 0
    assert main(fine_tune[:1] + ["ship"] + fine_tune[1:] + ["--ship-dir", str(tmp_path / "ship")]) == 0
    lineage = json.loads((tmp_path / "ship" / "MANIFEST.json").read_text())["init_from"]
    assert lineage == {"path": str(tmp_path / "ship"), "weights_sha256": parent_weights, "manifest": parent}
    assert weights_sha256(tmp_path / "ship") != parent_weights


def test_a_line_cut_by_a_crash_hides_nothing_appended_after_it(tmp_path):
    path = tmp_path / "responses.jsonl"
    append_jsonl(path, [{"id": "a"}, {"id": "b"}])
    path.write_bytes(path.read_bytes()[:-4])  # killed while writing "b"'s line
    assert read_jsonl(path) == [{"id": "a"}]  # "b" is pending again
    append_jsonl(path, [{"id": "b"}, {"id": "c"}])
    assert read_jsonl(path) == [{"id": "a"}, {"id": "b"}, {"id": "c"}]
    path.write_text('{"id": "a"}\n{"id": \n{"id": "c"}\n')  # damage in the middle is not hidden
    with pytest.raises(ValueError, match=":2 is not JSON"):
        read_jsonl(path)


def test_interleave_pending_keeps_finished_first_and_spreads_the_added_prompts():
    old = [Prompt(f"o{i}", "chat", f"old {i}", "t") for i in range(6)]
    added = [Prompt(f"n{i}", "math", f"new {i}", "t") for i in range(2)]
    order = [p.prompt_id for p in interleave_pending(old, {"o1", "o4"}, added)]
    assert order == ["o1", "o4", "o0", "n0", "o2", "o3", "n1", "o5"]
    assert [p.prompt_id for p in interleave_pending(old, set(old_id.prompt_id for old_id in old), added)] == [
        f"o{i}" for i in range(6)
    ] + ["n0", "n1"]


def test_cli_prompts_add_to_an_existing_data_directory(tmp_path):
    data = ["train-drafter", "prompts", "--data-dir", str(tmp_path)]
    with pytest.raises(ValueError, match="does not exist"):
        main(data + ["--add", "--seed", "1"])
    assert main(data + ["--num-prompts-per-category", "4", "--categories", "math", "chat"]) == 0
    first = [json.loads(line) for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    assert len(first) == 8
    with pytest.raises(ValueError, match="exists"):
        main(data + ["--num-prompts-per-category", "4"])
    (tmp_path / "responses.jsonl").write_text(json.dumps({"prompt_id": first[0]["prompt_id"]}) + "\n")
    assert (
        main(
            data
            + [
                "--add",
                "--seed",
                "1",
                "--categories",
                "math",
                "--math-templates",
                "broad",
                "--num-prompts-per-category",
                "3",
            ]
        )
        == 0
    )
    merged = [json.loads(line) for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    assert merged[0] == first[0]  # finished prompts first, unchanged
    assert sorted(r["prompt_id"] for r in merged[1:] if r["prompt_id"].startswith("math-s1-")) == [
        "math-s1-000000",
        "math-s1-000001",
        "math-s1-000002",
    ]
    assert {r["prompt_id"] for r in merged} >= {r["prompt_id"] for r in first} and len(merged) == 11
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["num_prompts"] == 11 and manifest["added_prompts"][0]["num_prompts"] == 3
    with pytest.raises(ValueError, match="another --seed"):
        main(
            data
            + [
                "--add",
                "--seed",
                "1",
                "--categories",
                "math",
                "--math-templates",
                "broad",
                "--num-prompts-per-category",
                "3",
            ]
        )


@pytest.mark.skipif(
    importlib.util.find_spec(default_model.PACKAGE) is None, reason=f"run: {default_model.INSTALL_HINT}"
)
def test_prompts_step_with_chat_prompts_the_target_writes_itself(tmp_path):
    """`--self-written code` on the embedded SmolLM2: whole user messages it wrote, starting with the code opening
    (each sample seeded on its own, so a rerun writes the same ones: seeded sampling is tested with the engine);
    math stays templated."""
    assert (
        main(
            [
                "train-drafter",
                "prompts",
                "--data-dir",
                str(tmp_path),
                "--categories",
                "code",
                "math",
                "--self-written",
                "code",
                "--num-prompts-per-category",
                "2",
                "--num-threads",
                "2",
            ]
        )
        == 0
    )
    records = [json.loads(line) for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    code = [r for r in records if r["category"] == "code"]
    assert len(records) == 4 and {r["source"] for r in code} == {"self"}
    assert all(r["text"].startswith("Write a Python function") and len(r["text"].split()) >= 4 for r in code)
    assert len({r["text"] for r in code}) == 2
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert "self_prompts.py" in manifest["sources"]["code"] and "templated" in manifest["sources"]["math"]
    with pytest.raises(ValueError, match="not among --categories"):
        main(
            [
                "train-drafter",
                "prompts",
                "--data-dir",
                str(tmp_path / "x"),
                "--categories",
                "math",
                "--self-written",
                "code",
            ]
        )


@pytest.mark.parametrize(
    "bad",
    [
        ["--max-steps", "0"],
        ["--checkpoint-every", "0"],
        ["--train-batch-size", "0"],
        ["--lr", "-1e-4"],
        ["--max-anchors", "0"],
        ["--block-size", "1"],
        ["--num-eval-prompts", "x"],
        ["--max-hours", "nan"],
        ["--gamma", "0"],
        ["--soft-target-weight", "-0.5"],
        ["--soft-target-top-k", "-1"],
    ],
)
def test_bad_training_values_are_usage_errors_before_any_step(bad, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train-drafter", "train", "--data-dir", "/nonexistent", *bad])
    assert exit_info.value.code == 2 and bad[0] in capsys.readouterr().err


def test_pipeline_refuses_what_would_mix_or_lose_data_and_names_the_fix(tiny_target, tmp_path, monkeypatch):
    """Steps run out of order, another target's data directory, a remake over finished responses, changed evaluation
    sizes, changed training settings: each a ValueError naming the fix, before anything is written. Ctrl-C in
    training keeps a checkpoint, and a resume may move the folder or change how often it saves."""
    import ddtree.training.train as train_module

    data, out = tmp_path / "data", tmp_path / "out"
    common = [
        "--target",
        str(tiny_target),
        "--data-dir",
        str(data),
        "--eval-dir",
        str(tmp_path / "eval"),
        "--out-dir",
        str(out),
        "--num-threads",
        "1",
    ]
    shape = [
        "--num-draft-layers",
        "1",
        "--block-size",
        "4",
        "--target-layer-ids",
        "0",
        "2",
        "--mask-token-id",
        "1",
        "--train-batch-size",
        "2",
        "--max-anchors",
        "3",
        "--num-negatives",
        "8",
    ]
    with pytest.raises(ValueError, match="run the prompts step first"):
        main(["train-drafter", "generate", *common])
    assert not (data / "manifest.json").exists()
    assert main(["train-drafter", "prompts", *common, "--num-prompts-per-category", "2"]) == 0
    with pytest.raises(ValueError, match="run the prompts and generate steps first"):
        main(["train-drafter", "train", *common, *shape])
    assert not out.exists()
    with pytest.raises(ValueError, match="run the train step first"):
        main(["train-drafter", "vocab", *common])
    assert (
        main(["train-drafter", "generate", *common, "--max-new-tokens", "6", "--stored-layer-ids", "0", "1", "2"]) == 0
    )
    # another target's directory: refused before the target loads
    other = tmp_path / "other_target"
    other.mkdir()
    with pytest.raises(ValueError, match="holds data of the target"):
        main(["train-drafter", "generate", *common[2:], "--target", str(other)])
    with pytest.raises(ValueError, match="holds data of the target"):
        main(["train-drafter", "train", *common[2:], "--target", str(other), *shape])
    # a remake of the prompts over finished responses would give old ids new texts
    (data / "prompts.jsonl").unlink()
    with pytest.raises(ValueError, match="use a new --data-dir"):
        main(["train-drafter", "prompts", *common, "--num-prompts-per-category", "2", "--seed", "7"])
    assert not (data / "prompts.jsonl").exists()
    layers = ["--stored-layer-ids", "0", "1", "2"]
    assert (
        main(["train-drafter", "eval-data", *common, *layers, "--num-eval-prompts", "1", "--max-new-tokens", "4"]) == 0
    )
    with pytest.raises(ValueError, match="holds 1 evaluation prompts"):
        main(["train-drafter", "eval-data", *common, *layers, "--num-eval-prompts", "2"])
    assert main(["train-drafter", "eval-data", *common, *layers, "--max-new-tokens", "4"]) == 0  # keeps its count

    # Ctrl-C at the third step: the two steps trained are kept
    real_block_loss, calls = train_module.block_loss, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_block_loss(*args, **kwargs)

    def interrupted_at_once(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_module, "block_loss", interrupted_at_once)  # nothing trained: nothing saved
    with pytest.raises(KeyboardInterrupt):
        main(["train-drafter", "train", *common, *shape, "--max-steps", "5", "--lr", "1e-2"])
    assert not (out / "checkpoint.pt").exists()
    monkeypatch.setattr(train_module, "block_loss", interrupted)
    with pytest.raises(KeyboardInterrupt):
        main(["train-drafter", "train", *common, *shape, "--max-steps", "5"])
    monkeypatch.setattr(train_module, "block_loss", real_block_loss)
    state = torch.load(out / "checkpoint.pt", weights_only=False)
    assert state["step"] == 2 and json.loads((out / "drafter" / "training_state.json").read_text())["step"] == 2
    assert [json.loads(line)["step"] for line in (out / "log.jsonl").read_text().splitlines()] == [1, 2]
    # changed settings are named; a moved folder (relative path) and another checkpoint interval resume
    with pytest.raises(ValueError, match="lr 0.0006 there vs 0.001 now"):
        main(["train-drafter", "train", *common, *shape, "--max-steps", "5", "--lr", "1e-3"])
    monkeypatch.chdir(tmp_path)
    relative = [a if a != str(out) else "out" for a in common]
    assert main(["train-drafter", "train", *relative, *shape, "--max-steps", "4", "--checkpoint-every", "3"]) == 0
    assert [json.loads(line)["step"] for line in (out / "log.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="holds data of the target"):  # the eval directories' target too
        main(["train-drafter", "eval", *common[2:], "--target", str(other)])
    with pytest.raises(ValueError, match="dflash_config .* there vs .* now"):  # --init-from names what differs
        main(
            [
                "train-drafter",
                "train",
                *common,
                *shape,
                "--out-dir",
                str(tmp_path / "out2"),
                "--max-steps",
                "1",
                "--init-from",
                str(out / "drafter"),
                "--mask-token-id",
                "2",
            ]
        )


def test_ctrl_c_in_generation_keeps_the_finished_responses(tiny_target, tmp_path, monkeypatch):
    from ddtree.models.target import TargetModel

    write_prompts(tmp_path, [Prompt(f"p{i}", "math", f"what is {i} and {i}?", "test") for i in range(6)])
    real_decode, calls = TargetModel.decode, []

    def decode(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # the first two prompts (3 tokens: 2 decode steps, or EOS sooner) are finished by now
            raise KeyboardInterrupt
        return real_decode(self, *args, **kwargs)

    monkeypatch.setattr(TargetModel, "decode", decode)
    with pytest.raises(KeyboardInterrupt):
        generate_responses_continuous(tmp_path, str(tiny_target), batch_size=2, max_new_tokens=3, stored_layer_ids=(1,))
    kept = read_jsonl(tmp_path / "responses.jsonl")
    assert 2 <= len(kept) < 6 and all(len(r["response_ids"]) <= 3 for r in kept)
    monkeypatch.setattr(TargetModel, "decode", real_decode)
    assert generate_responses_continuous(
        tmp_path, str(tiny_target), batch_size=2, max_new_tokens=3, stored_layer_ids=(1,)
    ) == 6 - len(kept)
    assert sorted(r["prompt_id"] for r in read_jsonl(tmp_path / "responses.jsonl")) == [f"p{i}" for i in range(6)]
