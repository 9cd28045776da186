"""The one model registry both services build from.

A network is one module: ``common/models/tables/NAME.py`` for tabular data or
``common/models/images/NAME.py`` for images, with a keyword-only ``build`` function
(see `common.models.registry` for its signature). The module's file name is the
model's name (``_`` read as ``-``: ``images/resnet18_gn.py`` is ``resnet18-gn``); the
registry lists the two folders without importing them, so the study schema, the
coordinator's control plane and `common` stay torch-free at import. Torch is imported
only by what builds or flattens a network: `common.models.build` and
`common.models.layout`.
"""

import importlib.util

from common.models.registry import (
    CUSTOM,
    Kind,
    ModelSpec,
    Task,
    check_params,
    kind_of,
    model_names,
    output_units,
)


def network_code_installed() -> bool:
    """Whether torch is installed here: the coordinator image has none (it serves round 1
    from `--initial-model` and lays evaluation buckets without the public probe)."""
    try:
        return importlib.util.find_spec("torch") is not None
    except ImportError:  # a finder that refuses it outright
        return False


__all__ = [
    "CUSTOM",
    "Kind",
    "ModelSpec",
    "Task",
    "check_params",
    "kind_of",
    "model_names",
    "network_code_installed",
    "output_units",
]
