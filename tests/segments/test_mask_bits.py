"""mask_bits: packed allowed sets (bit v % 32 of word v // 32), MaskTable dedup."""

import numpy as np
import pytest

from ac2_jax.segments import MaskTable, mask_words, pack_mask_bits, unpack_mask_bits


@pytest.mark.parametrize("V", [1, 31, 32, 33, 100, 161])
def test_pack_then_unpack_is_the_mask(V):
    rng = np.random.default_rng(V)
    m = rng.random((5, V)) < 0.4
    words = pack_mask_bits(m)
    assert words.dtype == np.uint32 and words.shape == (5, mask_words(V))
    np.testing.assert_array_equal(unpack_mask_bits(words, V), m)
    # Token v is bit v % 32 of word v // 32 (the sampler's layout).
    v = np.flatnonzero(m[0])
    assert all((words[0, t // 32] >> (t % 32)) & 1 for t in v)
    # Unpacking past the table's bits: not allowed.
    wide = unpack_mask_bits(words, mask_words(V) * 32 + 7)
    assert not wide[:, V:].any()


def test_pack_refuses_non_bool():
    with pytest.raises(ValueError, match="bool"):
        pack_mask_bits(np.ones((2, 40), np.int32))


def test_table_stores_each_mask_once_and_numbers_from_one():
    V = 70
    a, b = np.zeros(V, bool), np.zeros(V, bool)
    a[[1, 5]] = True
    b[[2, 69]] = True
    t = MaskTable()
    ids = t.add(pack_mask_bits(np.stack([a, b, a])))
    np.testing.assert_array_equal(ids, [1, 2, 1])
    np.testing.assert_array_equal(t.add(pack_mask_bits(b[None])), [2])
    assert len(t) == 2
    table = t.table(capacity=4)
    assert table.shape == (4, mask_words(V)) and not table[2:].any()
    np.testing.assert_array_equal(unpack_mask_bits(table[:2], V), np.stack([a, b]))
    with pytest.raises(ValueError, match="capacity 1 < 2"):
        t.table(capacity=1)
    with pytest.raises(ValueError, match="same vocabulary"):
        t.add(pack_mask_bits(np.ones((1, V + 64), bool)))
