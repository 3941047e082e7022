"""Peak memory and time of `load_published` of a full (non-LoRA) publish step.

A learner child publishes a random Decoder's params (`publish_weights`); a sampler child
builds a model of the same shape (other weights), resets its high-water mark
(`/proc/self/clear_refs`) and loads the step. Reported: the params' bytes, the
sampler's RSS before and after, its peak during the load, that peak over the RSS
before as a multiple of the params, and the load's seconds.

    python -m benchmarks.bench_load_published --hidden 2048 --ffn 6144 --layers 8
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from benchmarks.common import parser, print_table, write_json  # noqa: E402


def _rss_gb() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process, GB."""
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return tuple(int(fields[k].split()[0]) / 1e6 for k in ("VmRSS", "VmHWM"))  # type: ignore[return-value]


def _child(role: str, args) -> dict:
    import jax
    from flax import nnx

    from ac2_jax.models import Decoder, DecoderConfig
    from ac2_jax.models.params_io import load_published, publish_weights

    c = DecoderConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                      num_layers=args.layers, num_heads=args.hidden // 64,
                      num_kv_heads=max(args.hidden // 128, 1), head_dim=64, scan_layers=True)
    model = Decoder(c, rngs=nnx.Rngs(0 if role == "publish" else 1))
    nbytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    if role == "publish":
        publish_weights(model, args.dir, 1)
        return {"params_gb": nbytes / 1e9}
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM
    before, _ = _rss_gb()
    t0 = time.perf_counter()
    load_published(model, args.dir)
    seconds = time.perf_counter() - t0
    after, peak = _rss_gb()
    return {"params_gb": nbytes / 1e9, "rss_before_gb": before, "rss_after_gb": after,
            "peak_gb": peak, "peak_over_before_x_params": (peak - before) / (nbytes / 1e9),
            "load_s": seconds}


def main(argv=None):
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=6144)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--child", default=None, help="internal: publish | load")
    p.add_argument("--dir", default=None, help="internal: the publish directory")
    args = p.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(_child(args.child, args)), flush=True)
        return None
    shape = ["--hidden", str(args.hidden), "--ffn", str(args.ffn), "--layers", str(args.layers),
             "--vocab", str(args.vocab)]
    with tempfile.TemporaryDirectory() as d:
        results = {}
        for role in ("publish", "load"):
            out = subprocess.run([sys.executable, "-m", "benchmarks.bench_load_published",
                                  "--child", role, "--dir", os.path.join(d, "pub"), *shape],
                                 capture_output=True, text=True, check=True)
            line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")][-1]
            results[role] = json.loads(line[len("RESULT "):])
    row = results["load"]
    print_table([row], list(row))
    write_json(args.out, {"benchmark": "load_published", "args": vars(args), "row": row,
                          "loadavg": os.getloadavg()})
    return row


if __name__ == "__main__":
    main()
