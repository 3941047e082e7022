"""Host bookkeeping of the JaxSampler's cache rows: buckets, layout, prefix reuse."""

import concurrent.futures

import numpy as np
import pytest

from ac2_jax.sampling import SamplingParams, occupancy_metrics
from ac2_jax.sampling.engine.batching import Request, SamplerStats, SlotTable, pow2_bucket, resolve


def _req(prompt, **kw):
    return Request(prompt=list(prompt), params=SamplingParams(**kw),
                   future=concurrent.futures.Future(), seed=(5 << 32) + 7, stop_ids=(2,),
                   max_out=kw.get("max_tokens", 8))


def test_pow2_bucket():
    assert [pow2_bucket(n, 1, 16) for n in (1, 2, 3, 5, 16, 40)] == [1, 2, 4, 8, 16, 16]
    assert pow2_bucket(3, 8, 64) == 8 and pow2_bucket(100, 16, 96) == 96


def test_assign_release_and_prefix_reuse():
    t = SlotTable()
    t.relayout([], 4)
    a = _req([10, 11, 12, 13], temperature=0.5)
    row, reuse = t.pick_row(np.array(a.prompt), set())
    assert reuse == 0
    t.assign(row, a)
    assert t.arr["token"][row] == 13 and t.arr["pos"][row] == 3 and t.arr["active"][row]
    assert (t.arr["seed_lo"][row], t.arr["seed_hi"][row]) == (7, 5)
    rows = t.rows()
    assert rows.stop_ids.shape == (4, 4) and rows.stop_ids[row, 0] == 2
    # Two tokens generated; the last one was never fed, so 4 + 1 slots hold keys.
    a.gen = [20, 21]
    t.arr["pos"][row] = 5
    assert t.held(row) is a
    assert t.release(row) is a and t.active_rows() == []
    with pytest.raises(RuntimeError, match="holds no request"):
        t.held(row)
    np.testing.assert_array_equal(t.hist[row], [10, 11, 12, 13, 20])
    # The next turn extends that sequence: its row and 5 reusable tokens are found.
    assert t.pick_row(np.array([10, 11, 12, 13, 20, 21, 30]), set()) == (row, 5)
    # Reuse stops one short of the prompt's end and at the first difference.
    assert t.pick_row(np.array([10, 11, 12]), set()) == (row, 2)
    assert t.pick_row(np.array([10, 99, 12, 13]), set())[1] == 1
    # A taken row is skipped; unused rows are preferred over recently used ones.
    other, reuse = t.pick_row(np.array([10, 11, 12, 13, 20, 21]), {row})
    assert other != row and reuse == 0
    t.clear_history()
    assert t.pick_row(np.array([10, 11, 12, 13, 20, 21]), set())[1] == 0


def test_relayout_moves_rows():
    t = SlotTable()
    t.relayout([], 4)
    reqs = [_req([i + 1, i + 2]) for i in range(4)]
    for i, r in enumerate(reqs):
        t.assign(i, r)
    t.release(1)
    t.release(2)
    idx = t.relayout([3, 0], 2)  # compact to the two running rows
    np.testing.assert_array_equal(idx, [3, 0])
    assert t.req == [reqs[3], reqs[0]] and t.arr["token"].tolist() == [5, 2]
    idx = t.relayout([0, 1], 4)  # grow: new rows are empty
    np.testing.assert_array_equal(idx, [0, 1, 2, 2])
    assert t.req[2:] == [None, None] and t.free_rows() == [2, 3]


def test_resolve_ignores_callers_that_gave_up():
    r = _req([1, 2])
    r.future.cancel()
    resolve(r, result="x")  # no InvalidStateError
    r = _req([1, 2])
    resolve(r, exc=ValueError("boom"))
    with pytest.raises(ValueError, match="boom"):
        r.future.result()
    with pytest.raises(RuntimeError):
        SlotTable().pick_row(np.array([1, 2]), set())


def test_assign_is_all_or_nothing():
    """A value that does not fit the int32 row state raises before the row changes
    (it used to leave a half-written row behind)."""
    t = SlotTable()
    t.relayout([], 2)
    bad = _req([1, 2, 3], temperature=0.5)
    object.__setattr__(bad.params, "top_k", 2**40)  # forced past SamplingParams' checks
    with pytest.raises(OverflowError):
        t.assign(0, bad)
    assert t.req == [None, None] and not t.arr["active"].any() and t.arr["token"][0] == 0
    t.assign(0, _req([1, 2, 3], top_k=5))
    assert t.arr["top_k"][0] == 5 and t.active_rows() == [0]


def test_occupancy_metrics_are_the_work_between_two_snapshots():
    st = SamplerStats()
    before = st.counters()
    st.active_rows.update({4: 10, 2: 5})  # 10 decode steps with 4 rows, 5 with 2
    st.decode_steps, st.output_tokens, st.decode_s, st.prefill_s = 15, 50, 0.5, 0.25
    st.shapes.add(("decode_chunk", 4, 64, 4))
    st.cache_shrinks, st.prefix_tokens_dropped = 1, 30
    m = occupancy_metrics(before, st.counters(), max_batch=8)
    assert m["cache_shrinks"] == 1 and m["prefix_tokens_dropped"] == 30
    assert m["mean_active_rows"] == (4 * 10 + 2 * 5) / 15
    assert m["occupancy"] == m["mean_active_rows"] / 8
    assert m["decode_tokens_per_s"] == 100 and m["new_shapes"] == 1 and m["prefill_s"] == 0.25
    idle = occupancy_metrics(st.counters(), st.counters(), max_batch=8)
    assert idle["mean_active_rows"] == 0 and idle["decode_tokens_per_s"] == 0
