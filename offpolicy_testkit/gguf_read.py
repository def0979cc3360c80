"""Reading a GGUF file back: one tensor, dequantised, to compare an export (:func:`offpolicy.models.gguf.export_gguf`)
with the weights it came from and a quantiser with the simulated one."""

from __future__ import annotations

import os

import torch


def read_gguf_tensor(path: str | os.PathLike, name: str) -> torch.Tensor:
    """One tensor of a GGUF file, dequantised to float32 in transformers' ``[out, in]`` layout."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    for t in reader.tensors:
        if t.name == name:
            data = gguf.quants.dequantize(t.data, t.tensor_type)
            return torch.from_numpy(data.copy()).float().reshape([int(d) for d in reversed(t.shape.tolist())])
    raise ValueError(f"{path}: no tensor named {name!r}")
