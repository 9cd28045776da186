"""The one wire layout of a model: what the coordinator and SecAgg see of a network.

A model travels as one float32 vector: ``model.named_parameters()`` in order, each
tensor flattened row-major, described by a tuple of `TensorSpec` (float32,
little-endian). Both services and the demo take the layout, the vector and its inverse
from here.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from common.core.codec import TensorSpec
from common.core.errors import ValidationError


def model_layout(model: nn.Module) -> tuple[TensorSpec, ...]:
    """Wire layout of a torch model's parameters (float32, little-endian), in the order
    of the flat vector."""
    return tuple(
        TensorSpec(name, "<f4", tuple(int(d) for d in p.shape))
        for name, p in model.named_parameters()
    )


def flatten_parameters(model: nn.Module) -> np.ndarray:
    """All parameters as one float32 vector (order = ``model.named_parameters()``)."""
    with torch.no_grad():
        parts = [p.detach().reshape(-1).to("cpu", torch.float32) for p in model.parameters()]
        if not parts:
            return np.zeros(0, dtype=np.float32)
        return torch.cat(parts).numpy().copy()


def load_flat_parameters(model: nn.Module, vec: np.ndarray) -> None:
    """Copy a flat vector (as made by `flatten_parameters`) into the model in place."""
    flat = np.asarray(vec)
    total = sum(p.numel() for p in model.parameters())
    if flat.ndim != 1 or flat.shape[0] != total:
        raise ValidationError(f"parameter vector has shape {flat.shape}, model needs ({total},)")
    if not np.all(np.isfinite(flat)):
        raise ValidationError("parameter vector contains NaN or infinity")
    source = torch.from_numpy(np.ascontiguousarray(flat, dtype=np.float32))
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            n = p.numel()
            p.copy_(source[offset : offset + n].view_as(p).to(p.device, p.dtype))
            offset += n


def wire_model(model: nn.Module) -> tuple[tuple[TensorSpec, ...], np.ndarray]:
    """The layout and the float32 vector of a model, as the federation sends it."""
    return model_layout(model), flatten_parameters(model)
