"""benchmarks/bench_lora_vjp.py at toy size: all three variants run and time, the two
LoRA variants start from the same loss (the backward form changes how, not what), and
the module's product is restored after each build."""

from ac2_jax.models import lora
from benchmarks import bench_lora_vjp


def test_toy_ab_runs_every_variant(tmp_path):
    rows = bench_lora_vjp.main(["--hidden", "64", "--ffn", "128", "--layers", "2", "--vocab",
                                "256", "--tokens", "64", "--rounds", "2",
                                "--out", str(tmp_path / "ab.json")])
    by = {r["variant"]: r for r in rows}
    assert set(by) == {"custom", "autodiff", "full"}
    assert all(r["min_s"] > 0 for r in rows)
    assert abs(by["custom"]["first_loss"] - by["autodiff"]["first_loss"]) <= 1e-6 * max(
        abs(by["autodiff"]["first_loss"]), 1e-9)
    assert lora.lora_update is not bench_lora_vjp.autodiff_update
    assert (tmp_path / "ab.json").exists()
