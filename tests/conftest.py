"""Shared test settings: one intra-op thread per process (the machines have 2 cores, and every
multi-rank test runs several processes), and the hypothesis profile."""

import torch
from hypothesis import settings

torch.set_num_threads(1)
settings.register_profile("hicache", deadline=None, print_blob=True)
settings.load_profile("hicache")
