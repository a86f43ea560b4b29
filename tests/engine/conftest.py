"""Engine tests run torch on one thread: the box has 2 shared cores, and two torch threads
fighting other processes make small matmuls 5-10x slower."""

from __future__ import annotations

import torch

torch.set_num_threads(1)
