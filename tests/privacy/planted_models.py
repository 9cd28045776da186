"""TEST DOUBLE: global models a deviating coordinator plants to learn one bit per round.

Every weight is finite (a site's download check passes), but the forward pass is NaN
exactly on the records the coordinator targets and ordinary on every other record. A
site that could not upload after training on such a model (a NaN clipped sum, a NaN
score in its evaluation histogram) would tell the coordinator, by dropping out, whether
it holds a targeted record: one bit outside the ledger. The tests plant these and check
that a site behaves the same with and without the targeted patient.

* `plant_tabular`: a table model (the study's `mlp` or `logistic`). The MLP's first layer
  passes relu(scale (x_feature - threshold)), so only records above `threshold` light a
  hidden unit; the next layer multiplies by `scale` again (float32 overflows to +inf)
  and the output adds +inf and -inf: NaN. Logistic regression has one layer: for K >= 3
  classes (softmax regression) class 0's logit is big * sum of `features`, infinite
  exactly when that sum exceeds `threshold`, and the log-softmax of an infinite logit is
  NaN. (A binary logistic regression cannot be planted so: the gradient of BCE with
  logits is sigmoid(z) - y, finite for an infinite logit.)
* `plant_cnn`: the built-in `cnn` (two conv blocks with GroupNorm, a linear head).
  Block 1 and 2 carry a bright spot unchanged (a centre tap) into channels 0 and 1; the
  second GroupNorm's affine part passes relu(scale (xhat - threshold)), where xhat is the
  normalised brightness at a position (a lone bright spot on a dark image stands out far
  more than anything in a natural image); the head adds +head and -head times those
  two channels: NaN for a targeted image, 0 for every other.
"""

from __future__ import annotations

import torch
from torch import nn


def _linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


@torch.no_grad()
def plant_tabular(model: nn.Module, *, features: tuple[int, ...] = (0,),
                  threshold: float = 3.0, scale: float = 1e20) -> nn.Module:
    """Plant `model` (in place) to be NaN exactly on the records whose `features[0]` lies
    above `threshold` (the MLP), or whose `features` sum above it (softmax regression;
    module docstring)."""
    layers = _linears(model)
    for layer in layers:
        layer.weight.zero_()
        if layer.bias is not None:
            layer.bias.zero_()
    if len(layers) == 1:
        if layers[0].weight.shape[0] < 3:
            raise ValueError("a binary logistic regression cannot be planted (docstring)")
        big = 3.4028e38 / threshold
        if big > 1e38:
            raise ValueError("threshold below 3.4 needs weights beyond 1e38")
        layers[0].weight[0, list(features)] = big
        return model
    first, *middle, last = layers
    first.weight[:, features[0]] = scale
    assert first.bias is not None
    first.bias.fill_(-scale * threshold)
    for layer in middle:
        layer.weight.fill_(scale)
    signs = torch.ones(last.weight.shape[1])
    signs[1::2] = -1.0
    last.weight.copy_(signs.expand_as(last.weight) * scale)
    return model


@torch.no_grad()
def plant_cnn(model: nn.Module, *, threshold: float, scale: float = 1e20,
              head: float = 1e35) -> nn.Module:
    """Plant the built-in `cnn` (`common.models.images.cnn.SmallCNN`, in place) to be
    NaN exactly on images whose normalised brightness somewhere exceeds `threshold`
    after its second block (module docstring). `cnn_activation` gives that quantity."""
    conv1, norm1, _, _, conv2, norm2, _, _ = model.features  # type: ignore[misc]
    for layer in (conv1, conv2, model.head):
        layer.weight.zero_()
        layer.bias.zero_()
    conv1.weight[0, :, 1, 1] = 1.0  # every input channel's centre pixel, summed
    conv2.weight[0, 0, 1, 1] = 1.0
    conv2.weight[1, 0, 1, 1] = 1.0
    for norm in (norm1, norm2):
        norm.weight.zero_()
        norm.bias.zero_()
    norm1.weight[0] = 1.0
    norm2.weight[:2] = scale
    norm2.bias[:2] = -scale * threshold
    model.head.weight[0, 0] = head
    model.head.weight[0, 1] = -head
    return model


@torch.no_grad()
def cnn_activation(images: torch.Tensor) -> torch.Tensor:
    """Per image, the largest normalised brightness `plant_cnn` thresholds: the value
    of channel 0 after the planted network's second GroupNorm, before its affine part
    (computed with a planted copy at threshold 0 and scale 1)."""
    from common.models.images.cnn import SmallCNN

    probe = SmallCNN(in_channels=images.shape[1], num_classes=1)
    plant_cnn(probe, threshold=0.0, scale=1.0, head=1.0)
    out = probe.features[:6](images)  # up to and including the second GroupNorm
    return out[:, 0].reshape(images.shape[0], -1).max(dim=1).values
