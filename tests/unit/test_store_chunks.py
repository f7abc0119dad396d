"""How a multi-row write is cut into statements."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from meshforge.store.sql import chunk_sizes


@given(st.integers(0, 5000), st.integers(1, 600), st.booleans())
def test_chunks_carry_every_row_once_and_never_more_than_a_statement_may(
    total: int, per: int, shapes: bool
) -> None:
    sizes = chunk_sizes(total, per, shapes=shapes)
    assert sum(sizes) == total and all(0 < size <= per for size in sizes)


@given(st.integers(1, 600))
def test_with_shapes_any_number_of_rows_uses_few_statement_texts(per: int) -> None:
    texts = {size for total in range(3 * per) for size in chunk_sizes(total, per, shapes=True)}
    assert len(texts) <= per.bit_length() + 8


def test_a_small_rest_goes_in_one_statement() -> None:
    assert chunk_sizes(1100, 500) == [500, 500, 100]
    assert chunk_sizes(1100, 500, shapes=True) == [500, 500, 64, 32, 4]
    assert chunk_sizes(1100, 500, shapes=True) == [500, 500, 64, 32, 4]
    assert chunk_sizes(0, 500, shapes=True) == []
    assert chunk_sizes(7, 500, shapes=True) == [7]
    assert chunk_sizes(77, 500, shapes=True) == [64, 8, 5]
