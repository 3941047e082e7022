"""The experts a mixture-of-experts sampler routed each token to, stored compactly.

`Completion.routed_experts` holds, for every token of `prompt_ids + output_ids`,
the k expert ids of each MoE layer, as the text

    "<layers>,<k>,<bytes>:<base64 of the ids, little-endian, bytes each>"

(1 byte per id when the experts fit one, else 2; Qwen3-30B-A3B: 48 layers x 8
ids = 384 bytes a token). The all-ones value (255 / 65535) marks a token whose
routing was not recorded (a prompt token whose keys the sampler reused from
an earlier request, the last output token, which is never fed back); it
decodes to -1, which the learner's replay reads as "route this token
yourself" (`models.moe_decoder`).
"""

from __future__ import annotations

import base64

import numpy as np

__all__ = ["decode_routing", "encode_routing", "routing_length"]


def encode_routing(ids: np.ndarray) -> str:
    """int ids [tokens, layers, k] (negative: not recorded) -> the stored text."""
    a = np.asarray(ids)
    if a.ndim != 3:
        raise ValueError(f"encode_routing: want ids [tokens, layers, k], got shape {a.shape}")
    width = 1 if a.size == 0 or a.max() < 255 else 2
    if a.size and a.max() >= 65535:
        raise ValueError(f"encode_routing: expert id {int(a.max())} does not fit 16 bits")
    dtype = np.dtype("<u1" if width == 1 else "<u2")
    packed = np.where(a < 0, np.iinfo(dtype).max, a).astype(dtype)
    text = base64.b64encode(packed.tobytes()).decode("ascii")
    return f"{a.shape[1]},{a.shape[2]},{width}:{text}"


def decode_routing(text: str) -> np.ndarray:
    """The stored text -> int32 ids [tokens, layers, k] (-1: not recorded)."""
    head, _, body = text.partition(":")
    try:
        layers, k, width = (int(x) for x in head.split(","))
        dtype = np.dtype("<u1" if width == 1 else "<u2")
        raw = np.frombuffer(base64.b64decode(body, validate=True), dtype)
        ids = raw.reshape(-1, layers, k)
    except ValueError as e:
        raise ValueError(f"decode_routing: not a routed-experts record ({e})") from None
    return np.where(ids == np.iinfo(dtype).max, -1, ids.astype(np.int32))


def routing_length(text: str) -> int:
    """How many tokens a stored record covers (without decoding it)."""
    head, _, body = text.partition(":")
    layers, k, width = (int(x) for x in head.split(","))
    n_bytes = len(body) // 4 * 3 - body[-2:].count("=")
    return n_bytes // (layers * k * width)
