import torch

from meshy.dataplane import HOST
from meshy.train.collectives import reduce_over_ranks


def test_reducing_in_a_single_process_returns_the_tensor_unchanged():
    """No process group (one process): nothing to reduce with, and none is needed. Several ranks run it in
    tests/train/service_ranks.py and fsdp_grads.py."""
    counts = torch.tensor([1.0, 2.0], device=HOST)
    assert reduce_over_ranks(counts) is counts and counts.tolist() == [1.0, 2.0]
