"""bench_decode_working_set at toy size: one gemm row per (batch, weight size), every
attention form per batch (checked equal inside the benchmark), positive times."""

from benchmarks.bench_decode_working_set import FORMS, attention_rows, gemm_rows


def test_gemm_chain_rows_and_attention_forms_at_toy_size():
    g = gemm_rows([2], [0.75], rounds=1, inner=1)
    assert [(r["batch"], r["weights_mb"]) for r in g] == [(2, 1.5)]
    assert g[0]["xla_us"] > 0 and g[0]["numpy_us"] > 0
    a = attention_rows([2], slots=16, rounds=1, inner=1)
    assert [r["form"] for r in a] == list(FORMS) and all(r["us"] > 0 for r in a)
