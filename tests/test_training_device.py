"""`ddtree train-drafter --device/--dtype` on a tiny random Llama target: the device is checked before any work,
an explicit `--device cpu` is exactly the default, the bf16 autocast path trains and resumes in float32 (the
cross-device resume contract: CPU checkpoints), and bf16 generation / evaluation store and report what they
should. There is no GPU here: the CUDA path itself is untested (docs/drafter.md, "Training on GPUs")."""

import json

import pytest
import torch
from safetensors.torch import load_file

from ddtree.cli import main
from ddtree.models.dflash import load_dflash
from ddtree.training.blocks import IGNORE_INDEX, build_block_batch
from ddtree.training.generate import generate_responses, generate_responses_continuous, write_prompts
from ddtree.training.prompts import CATEGORIES, Prompt
from ddtree.training.target import resolve_device, resolve_dtype

TRAIN_ARGS = [
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
    "--num-threads",
    "1",
]


@pytest.fixture(scope="module")
def tiny_data(tiny_target, tmp_path_factory):
    """Six greedy responses with features at layers 0-2, made through the CLI with an explicit `--device cpu`."""
    data_dir = tmp_path_factory.mktemp("data")
    write_prompts(data_dir, [Prompt(f"p{i}", CATEGORIES[i % 3], f"question number {i}?", "test") for i in range(6)])
    assert (
        main(
            [
                "train-drafter",
                "generate",
                "--target",
                str(tiny_target),
                "--data-dir",
                str(data_dir),
                "--device",
                "cpu",
                "--max-new-tokens",
                "8",
                "--batch-size",
                "3",
                "--stored-layer-ids",
                "0",
                "1",
                "2",
                "--num-threads",
                "1",
            ]
        )
        == 0
    )
    manifest = json.loads((data_dir / "manifest.json").read_text())
    assert manifest["generation"]["device"] == "cpu" and manifest["generation"]["dtype"] == "float32"
    return data_dir


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised where CUDA is unavailable")
def test_unavailable_device_is_rejected_before_any_work(tiny_target, tmp_path):
    data_dir = tmp_path / "data"
    with pytest.raises(ValueError, match=r"--device 'cuda'.*torch\.cuda\.is_available\(\) is False"):
        main(
            [
                "train-drafter",
                "prompts",
                "generate",
                "--device",
                "cuda",
                "--data-dir",
                str(data_dir),
                "--target",
                str(tiny_target),
            ]
        )
    assert not data_dir.exists()  # not even the prompts step ran
    with pytest.raises(ValueError, match="--device 'tpu' is not a torch device"):
        resolve_device("tpu")
    with pytest.raises(ValueError, match="cpu or cuda only"):
        resolve_device("meta")
    # the library entry points check too, before loading anything
    write_prompts(tmp_path, [Prompt("p0", "chat", "hi", "test")])
    for generate in (generate_responses, generate_responses_continuous):
        with pytest.raises(ValueError, match="--device 'cuda'"):
            generate(tmp_path, str(tiny_target), device="cuda")
    assert not (tmp_path / "responses.jsonl").exists()


def test_default_dtype_follows_the_device():
    assert resolve_dtype(None, torch.device("cpu")) == torch.float32
    assert resolve_dtype(None, torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ValueError, match="--dtype"):
        resolve_dtype("float16", torch.device("cpu"))


def test_explicit_cpu_device_trains_exactly_like_the_default(tiny_target, tiny_data, tmp_path):
    runs = {"default": [], "explicit": ["--device", "cpu", "--dtype", "float32"]}
    for name, extra in runs.items():
        assert (
            main(
                [
                    "train-drafter",
                    "train",
                    "--target",
                    str(tiny_target),
                    "--data-dir",
                    str(tiny_data),
                    "--out-dir",
                    str(tmp_path / name),
                    "--max-steps",
                    "2",
                    *TRAIN_ARGS,
                    *extra,
                ]
            )
            == 0
        )
    states = {name: torch.load(tmp_path / name / "checkpoint.pt", weights_only=False) for name in runs}
    for key, tensor in states["default"]["model"].items():
        assert torch.equal(tensor, states["explicit"]["model"][key]), key
    moments, other_moments = (s["optimizer"]["state"] for s in states.values())
    assert moments and all(torch.equal(t, other_moments[i][k]) for i, slot in moments.items() for k, t in slot.items())
    logs = {
        name: [json.loads(line) for line in (tmp_path / name / "log.jsonl").read_text().splitlines()] for name in runs
    }
    for a, b in zip(logs["default"], logs["explicit"], strict=True):
        assert {k: v for k, v in a.items() if k != "hours"} == {k: v for k, v in b.items() if k != "hours"}
    manifest = json.loads((tmp_path / "explicit" / "manifest.json").read_text())
    assert manifest["train_device"] == "cpu" and manifest["train_dtype"] == "float32"


def test_bf16_autocast_training_resumes_in_float32_and_evaluates_in_bf16(tiny_target, tiny_data, tmp_path):
    common = [
        "train-drafter",
        "--target",
        str(tiny_target),
        "--data-dir",
        str(tiny_data),
        "--out-dir",
        str(tmp_path / "out"),
        *TRAIN_ARGS,
    ]
    assert main(common[:1] + ["train"] + common[1:] + ["--max-steps", "2", "--dtype", "bfloat16"]) == 0
    fp32_out = ["--out-dir", str(tmp_path / "fp32"), "--max-steps", "1"]
    assert main(common[:1] + ["train"] + common[1:] + fp32_out) == 0
    loss_bf16, loss_fp32 = (
        json.loads((tmp_path / d / "log.jsonl").read_text().splitlines()[0])["loss"] for d in ("out", "fp32")
    )
    assert loss_bf16 != loss_fp32 and abs(loss_bf16 - loss_fp32) < 0.05 * loss_fp32  # autocast ran, and is close
    state = torch.load(tmp_path / "out" / "checkpoint.pt", weights_only=False)
    # master weights and AdamW moments stay float32, and every tensor is a CPU tensor (resumable on any device)
    tensors = list(state["model"].values()) + [t for s in state["optimizer"]["state"].values() for t in s.values()]
    assert all(t.device.type == "cpu" for t in tensors)
    assert all(t.dtype == torch.float32 for t in state["model"].values())
    # resumed with the other precision: the same configuration, so it continues from step 2
    assert main(common[:1] + ["train"] + common[1:] + ["--max-steps", "3", "--dtype", "float32"]) == 0
    log = [json.loads(line) for line in (tmp_path / "out" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor([r["loss"], r["grad_norm"]])).all() for r in log)
    # evaluation in bf16: the data set stands in for every evaluation category
    for category in CATEGORIES:
        (tmp_path / "eval" / category).parent.mkdir(exist_ok=True)
        (tmp_path / "eval" / category).symlink_to(tiny_data, target_is_directory=True)
    assert (
        main(
            common[:1]
            + ["eval"]
            + common[1:]
            + [
                "--eval-dir",
                str(tmp_path / "eval"),
                "--dtype",
                "bfloat16",
                "--budgets",
                "2",
                "4",
                "--max-eval-sequences",
                "2",
            ]
        )
        == 0
    )
    tau = json.loads((tmp_path / "out" / "drafter" / "tau.json").read_text())
    assert tau["device"] == "cpu" and tau["dtype"] == "bfloat16"
    assert all(r["num_sequences"] == 2 and 1.0 <= r["tau_chain"] <= r["tau_tree_B4"] + 1e-9 for r in tau["results"])
    config, _ = load_dflash(tmp_path / "out" / "drafter")
    assert config.target_layer_ids == [0, 2]


def test_bf16_generation_stores_bf16_cpu_features(tiny_target, tmp_path):
    prompts = [Prompt(f"p{i}", "chat", text, "test") for i, text in enumerate(["hello there", "what is 2 and 3?"])]
    layers = (0, 2)
    for name, generate in (("runner", generate_responses_continuous), ("hf", generate_responses)):
        write_prompts(tmp_path / name, prompts)
        assert (
            generate(
                tmp_path / name,
                str(tiny_target),
                batch_size=2,
                max_new_tokens=5,
                stored_layer_ids=layers,
                device="cpu",
                dtype=torch.bfloat16,
            )
            == 2
        )
        for line in (tmp_path / name / "responses.jsonl").read_text().splitlines():
            r = json.loads(line)
            features = load_file(str(tmp_path / name / "features" / r["shard"]))[r["prompt_id"]]
            assert features.dtype == torch.bfloat16 and features.device.type == "cpu"
            assert features.shape == (len(r["prompt_ids"]) + len(r["response_ids"]) - 1, len(layers), 64)


def test_block_batch_labelled_rows_are_the_labelled_positions():
    batch = build_block_batch([list(range(3, 12)), list(range(5, 10))], [[2, 5], [3]], block_size=4, mask_token_id=1)
    expected = (batch.labels.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)
    assert torch.equal(batch.labelled_rows, expected) and batch.labelled_rows.numel() > 0
    moved = batch.to("cpu")
    assert moved.labelled_rows is batch.labelled_rows  # already there: nothing copied
