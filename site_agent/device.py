"""Choosing the torch device at run time: a GPU when the hospital has one, unless forced."""

from __future__ import annotations

import torch

from common.core.errors import ConfigError

DEVICE_CHOICES = ("auto", "cpu", "cuda")


def select_device(requested: str = "auto") -> torch.device:
    """``auto``: first CUDA device if available, else CPU; ``cpu``/``cuda[:N]``: forced.

    Forcing ``cuda`` on a machine without one is a configuration error, not a silent
    fallback: a site that asked for its GPU should know it is not using it.
    """
    choice = requested.strip().lower()
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cpu":
        return torch.device("cpu")
    if choice == "cuda" or choice.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise ConfigError("device", f"{requested!r} requested but CUDA is not available")
        device = torch.device(choice)
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError("device", f"{requested!r}: only {torch.cuda.device_count()} GPUs")
        return device
    raise ConfigError("device", f"unknown device {requested!r}; use auto, cpu or cuda[:N]")
