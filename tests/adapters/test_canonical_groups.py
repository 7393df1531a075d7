"""The canonical gradient layout: a pure function of the parameters and DDP's caps."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lm_resiliency.adapters.canonical import canonical_groups

pytestmark = pytest.mark.timeout(60)

DTYPES = [torch.float32, torch.bfloat16, torch.float64]


@settings(max_examples=80, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(1, 300), st.sampled_from(range(len(DTYPES)))), max_size=25),
    first_cap=st.integers(1, 2000),
    cap=st.integers(1, 4000),
)
def test_groups_partition_parameters_by_dtype_in_reverse_order(
    shapes: list[tuple[int, int]], first_cap: int, cap: int
) -> None:
    params = [torch.empty(n, dtype=DTYPES[d]) for n, d in shapes]
    groups = canonical_groups(params, first_cap, cap)
    flat = [i for g in groups for i in g]
    assert sorted(flat) == list(range(len(params)))  # every parameter exactly once
    for g in groups:
        assert g and len({params[i].dtype for i in g}) == 1
        assert g == sorted(g, reverse=True)  # the order gradients usually become ready in
        closed_early = g[:-1]
        # A group closes as soon as it reaches its cap: no member but the last one crosses it.
        size = 0
        for i in closed_early:
            size += params[i].numel() * params[i].element_size()
            assert size < max(first_cap, cap)
    assert groups == canonical_groups(params, first_cap, cap)  # deterministic


def test_first_group_is_small_then_capped() -> None:
    params = [torch.empty(100) for _ in range(10)]  # 400 bytes each
    groups = canonical_groups(params, first_cap=400, cap=1200)
    assert groups == [[9], [8, 7, 6], [5, 4, 3], [2, 1, 0]]
