"""How benchmarks/decode_graphs.py reports whether eager and replayed decode steps gave the same greedy ids."""

from __future__ import annotations

from benchmarks.decode_graphs import agreement, first_differences


def test_identical_requests_have_no_first_difference():
    assert first_differences([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]]) == [None, None]
    assert agreement([None, None], 3) == "all 2"


def test_a_request_parts_at_its_first_differing_token():
    assert first_differences([[1, 2, 3], [4, 5, 6], [7, 8]], [[1, 9, 3], [4, 5, 6], [0, 8]]) == [1, None, 0]
    assert agreement([1, None, 0], 3) == "1 of 3; others from token 0 to 1 of 3"


def test_a_shorter_output_parts_where_it_ends():
    assert first_differences([[1, 2, 3]], [[1, 2]]) == [2]
