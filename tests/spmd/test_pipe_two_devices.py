"""Pipe on a 1 x 2 mesh (two emulated devices) equals the unpipelined model."""

import pytest

from pipe_checks import assert_matches_reference, tiny_lm, tiny_mlp
from tiers import in_full_tier

CPU_NUM_DEVICES = 2


@pytest.mark.parametrize(("factory", "chunks"), [(tiny_mlp, 2), in_full_tier(tiny_lm, 1), in_full_tier(tiny_lm, 8)])
def test_one_by_two_mesh(factory, chunks):
    assert_matches_reference(factory(), stages=2, data=1, chunks=chunks, rows_per_replica=2)
