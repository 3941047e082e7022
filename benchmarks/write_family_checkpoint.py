"""Writes a random HF checkpoint of a real model's shape, from transformers' own config
classes, for `benchmarks.bench_real_size --ckpt DIR` (issue 34: Qwen2.5, Mistral).

    python -m benchmarks.write_family_checkpoint --shape qwen2.5-0.5b --out /tmp/q25
    python -m benchmarks.write_family_checkpoint --shape mistral-7b --layers 2 --out /tmp/m7

Shapes are the published config.json sizes; `--layers` cuts the depth (the
largest that fits one fp32 RL step on a small machine). Weights are
transformers' random init (seed 0), saved in fp32.
"""

from __future__ import annotations

import argparse
import os

SHAPES = {
    # Qwen/Qwen2.5-0.5B-Instruct config.json
    "qwen2.5-0.5b": ("Qwen2Config", dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        use_sliding_window=False, sliding_window=32768, max_window_layers=21)),
    # Qwen/Qwen2.5-1.5B-Instruct config.json
    "qwen2.5-1.5b": ("Qwen2Config", dict(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        use_sliding_window=False, sliding_window=32768, max_window_layers=21)),
    # mistralai/Mistral-7B-v0.1 config.json (sliding_window 4096)
    "mistral-7b": ("MistralConfig", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=4096)),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--layers", type=int, default=0, help="cut to this many layers (0: all)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    import torch
    import transformers

    cls, kw = SHAPES[args.shape]
    if args.layers:
        kw = {**kw, "num_hidden_layers": args.layers}
        if "max_window_layers" in kw:
            kw["max_window_layers"] = min(kw["max_window_layers"], args.layers)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        getattr(transformers, cls)(**kw), dtype=torch.float32)
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out)
    n = sum(t.numel() for t in model.parameters())
    print(f"{args.shape} ({kw['num_hidden_layers']} layers): {n / 1e6:.0f}M params -> {args.out}")


if __name__ == "__main__":
    main()
