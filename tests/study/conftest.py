"""One torch thread: the test machine's cores are shared, and tiny models only lose time
to thread contention."""

from __future__ import annotations

import torch

torch.set_num_threads(1)
