"""Reading generated sequences and their cached target features."""

from __future__ import annotations

import json
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from ddtree.training.generate import read_jsonl


@dataclass
class Sequence:
    prompt_id: str
    category: str
    token_ids: list[int]  # prompt + response
    prompt_length: int
    shard: str
    data_dir: Path | None = None  # the data directory whose features/ holds the shard


def is_validation(prompt_id: str, fraction: float) -> bool:
    """A stable split by prompt id, so it survives resumes and a growing data set."""
    return (zlib.crc32(prompt_id.encode()) % 10_000) < fraction * 10_000


def read_sequences(data_dir: Path) -> list[Sequence]:
    data_dir = Path(data_dir)
    return [
        Sequence(
            r["prompt_id"],
            r["category"],
            r["prompt_ids"] + r["response_ids"],
            len(r["prompt_ids"]),
            r["shard"],
            data_dir,
        )
        for r in read_jsonl(data_dir / "responses.jsonl")
        if len(r["response_ids"]) >= 2
    ]


def stored_layer_ids(data_dir: Path) -> list[int]:
    manifest = json.loads((data_dir / "manifest.json").read_text())
    return list(manifest["stored_layer_ids"])


class FeatureReader:
    """Target features of one sequence, [num_tokens - 1, len(layer_ids) * hidden] in `dtype` (float32 by default;
    bfloat16 is the stored precision, so it loses nothing), from the shards."""

    def __init__(
        self,
        data_dir: Path,
        stored_layer_ids: list[int],
        layer_ids: list[int],
        max_open: int = 64,
        dtype: torch.dtype = torch.float32,
    ):
        missing = [i for i in layer_ids if i not in stored_layer_ids]
        if missing:
            raise ValueError(f"target layers {missing} were not stored (stored: {stored_layer_ids})")
        self.features_dir = data_dir / "features"
        self.columns = torch.tensor([stored_layer_ids.index(i) for i in layer_ids])
        self.max_open = max_open
        self.dtype = dtype
        self._open: OrderedDict[str, object] = OrderedDict()

    def _shard(self, seq: Sequence):
        from safetensors import safe_open

        handle = self._open.get(seq.shard)
        if handle is None:
            handle = safe_open(str(self.features_dir / seq.shard), framework="pt")
            self._open[seq.shard] = handle
            if len(self._open) > self.max_open:
                self._open.popitem(last=False)
        return handle

    def soft_targets(self, seq: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's top-k at each response token: ids [R, K] int64 and log-probabilities [R, K] float32."""
        from ddtree.training.generate import soft_target_keys

        handle = self._shard(seq)
        ids_key, logprobs_key = soft_target_keys(seq.prompt_id)
        if ids_key not in handle.keys():
            raise ValueError(f"{seq.shard} holds no soft targets for {seq.prompt_id}")
        ids, logprobs = handle.get_tensor(ids_key), handle.get_tensor(logprobs_key)
        if ids.shape[0] != len(seq.token_ids) - seq.prompt_length:
            raise ValueError(f"soft targets of {seq.prompt_id} have {ids.shape[0]} rows for its response")
        return ids.long(), logprobs.float()

    def __call__(self, seq: Sequence) -> torch.Tensor:
        stored = self._shard(seq).get_tensor(seq.prompt_id)  # [N - 1, num_stored, H] bf16
        if stored.shape[0] != len(seq.token_ids) - 1:
            raise ValueError(f"features of {seq.prompt_id} have {stored.shape[0]} rows for {len(seq.token_ids)} tokens")
        return stored.index_select(1, self.columns).flatten(1).to(self.dtype)  # [N - 1, F]


def pad_features(features: list[torch.Tensor]) -> torch.Tensor:
    """[B, C, F] zero-padded; padded rows are never attended (the mask only opens positions < anchor)."""
    c = max(f.shape[0] for f in features)
    out = torch.zeros((len(features), c, features[0].shape[1]), dtype=features[0].dtype)
    for b, f in enumerate(features):
        out[b, : f.shape[0]] = f
    return out


class DataSetReader:
    """The FeatureReaders of several data directories (each with its own stored layers): a sequence is read from
    the directory it came from (`Sequence.data_dir`), so data sets made apart train together."""

    def __init__(self, data_dirs: list[Path], layer_ids: list[int], dtype: torch.dtype = torch.float32):
        self.readers = {
            Path(d): FeatureReader(Path(d), stored_layer_ids(Path(d)), layer_ids, dtype=dtype) for d in data_dirs
        }

    def __call__(self, seq: Sequence) -> torch.Tensor:
        return self.readers[seq.data_dir](seq)

    def soft_targets(self, seq: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
        return self.readers[seq.data_dir].soft_targets(seq)
