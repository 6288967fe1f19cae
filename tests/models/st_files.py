"""Reading and writing a checkpoint folder's tensors the way published checkpoints store them (single file, or shards
named model-0000i-of-0000n.safetensors with a model.safetensors.index.json)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX_FILE = "model.safetensors.index.json"


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file in `folder` (tiny test checkpoints only: all in memory)."""
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name).clone()
    return tensors


def write_tensors(folder: Path, tensors: dict[str, torch.Tensor], shards: int = 1) -> None:
    """Replace the folder's weights with `tensors`, split over `shards` files in name order (so a quantized layer's
    parts can land in different shards, which the reader must handle)."""
    for old in list(folder.glob("*.safetensors")) + list(folder.glob(INDEX_FILE)):
        old.unlink()
    names = sorted(tensors)
    if shards == 1:
        save_file({n: tensors[n].contiguous() for n in names}, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    per_shard = -(-len(names) // shards)
    weight_map: dict[str, str] = {}
    for i in range(shards):
        chunk = names[i * per_shard : (i + 1) * per_shard]
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in chunk}, str(folder / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in chunk})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
