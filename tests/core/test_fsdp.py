"""FSDP2 (``fully_shard``) is not preconditioned yet (docs/fsdp.md is the design): a sharded
model is refused with the reason and the fix, whether it was sharded before the
preconditioner was built or after, never with DTensor's own error from deep in a step."""

from __future__ import annotations

import pytest
from support.fsdp_workers import sharded_refused
from support.harness import run_distributed


@pytest.mark.parametrize("shard_first", [True, False])
def test_a_sharded_model_is_refused_with_the_fix(shard_first: bool) -> None:
    said = run_distributed(sharded_refused, 2, shard_first=shard_first)
    for message in said:
        assert "sharded parameters" in message, message
        assert "docs/fsdp.md" in message
        assert "DistributedDataParallel" in message
        assert "layers 0, 2" in message
