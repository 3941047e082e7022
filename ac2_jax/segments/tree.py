"""Shared-prefix tree packing: a prompt shared by many segments is computed once.

Segments that share a prefix (a GRPO group's prompt, earlier turns before a
fork, n responses to one request) are merged into a token trie, laid out
depth-first in one row. Each token keeps its depth as position; token k is
visible to queries k..subtree_end[k] (its DFS subtree), i.e. every token sees
exactly its ancestors (`ac2_jax.losses.tree_attention_mask`).

Trie nodes are keyed by (token, next token, loss key), not by token alone, so
every node has exactly one prediction target and the batch keeps the flat
layout's `targets` convention. The loss key is None when the prediction is not
trained, else (task, sampling params, the segment's features there): trained
tokens merge only when their loss terms are identical. A merged node's
`loss_mask` is the number of paths through it (the count) and its
`loss_weight` their mean weight, so count x weight is the sum of the paths'
weights and `task_mean`, `token_mean` and `constant` losses equal the flat
layout's. (`segment_mean` is not defined on merged tokens.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ac2_jax.segments.batch import (
    PackedBatch,
    empty_batch,
    feature_dtypes,
    packed_lengths,
    pad_rows,
    pow2_bucket,
    routing_shape,
    task_names,
)
from ac2_jax.segments.constraints import resolve_constraints
from ac2_jax.segments.segments import Segment


class _Node:
    __slots__ = ("key", "children", "segment", "count", "weighted")

    def __init__(self, key, segment):
        self.key = key
        self.children: dict = {}
        self.segment = segment  # first segment through this node
        self.count = 0.0  # sum of the paths' loss-mask counts
        self.weighted = 0.0  # sum of count x segment weight


def _path_keys(s: Segment, n: int, names: Sequence[str]) -> list[tuple[Any, ...]]:
    """Trie keys of the first n tokens of `s`; feature values in the order `names` (the
    batch's: `_layout` writes them back by position, whatever each segment's dict order)."""
    keys: list[tuple[Any, ...]] = []
    for i in range(n):
        if i + 1 < n:
            m = float(s.loss_mask[i + 1])
            j = i + 1
            loss_key = (
                (
                    s.task,
                    float(s.temperature[j]),
                    int(s.top_k[j]),
                    float(s.top_p[j]),
                    *(s.features[name][j].item() for name in names),
                )
                if m > 0
                else None
            )
            keys.append((int(s.tokens[i]), int(s.tokens[i + 1]), loss_key))
        else:
            keys.append((int(s.tokens[i]), None, None))
    return keys


def _shared_length(root: _Node, keys: list[tuple]) -> int:
    node, depth = root, 0
    for k in keys:
        child = node.children.get(k)
        if child is None:
            break
        node, depth = child, depth + 1
    return depth


def _insert(root: _Node, keys: list[tuple], s: Segment, index: int) -> None:
    node = root
    for i, k in enumerate(keys):
        child = node.children.get(k)
        if child is None:
            child = node.children[k] = _Node(k, index)
        if k[2] is not None:
            child.count += float(s.loss_mask[i + 1])
            child.weighted += float(s.loss_mask[i + 1]) * s.weight
        node = child


def _layout(root: _Node, row: dict, r: int, task_index: dict, segments) -> None:
    """Writes the forest under `root` depth-first (preorder) into row r."""
    pos = 0
    # Entries: ("open", node, depth, tree_id) or ("close", index): a node's
    # subtree ends where the DFS is when its close entry comes off the stack.
    stack: list[tuple[Any, ...]] = [
        ("open", c, 0, t) for t, c in enumerate(root.children.values(), start=1)
    ][::-1]
    while stack:
        entry = stack.pop()
        if entry[0] == "close":
            row["subtree_end"][r, entry[1]] = pos - 1
            continue
        _, node, depth, tree_id = entry
        tok, target, loss_key = node.key
        s = segments[node.segment]
        row["tokens"][r, pos] = tok
        row["targets"][r, pos] = 0 if target is None else target
        row["positions"][r, pos] = depth
        row["segment_ids"][r, pos] = tree_id
        row["segment_index"][r, pos] = node.segment
        row["task_ids"][r, pos] = task_index[s.task if loss_key is None else loss_key[0]]
        if loss_key is not None:
            row["loss_mask"][r, pos] = node.count
            row["loss_weight"][r, pos] = node.weighted / node.count if node.count else 0.0
            (
                row["temperature"][r, pos],
                row["top_k"][r, pos],
                row["top_p"][r, pos],
            ) = loss_key[1:4]
            for name, value in zip(row["features"], loss_key[4:], strict=True):
                row["features"][name][r, pos] = value
        stack.append(("close", pos))
        stack.extend(
            ("open", c, depth + 1, tree_id) for c in reversed(list(node.children.values()))
        )
        pos += 1


def pack_segment_tree(
    segments: Sequence[Segment],
    seq_len: int,
    *,
    truncate: bool = False,
    min_rows: int = 0,
    rows_multiple: int = 1,
    min_tasks: int = 1,
    min_segments: int = 1,
    min_masks: int = 1,
    constraint_masks: np.ndarray | None = None,
) -> PackedBatch:
    """Packs segments as prefix tries, one forest per row of `seq_len` tokens.

    Segments are sorted by content so that shared prefixes meet, then added
    to the current row while its trie fits. Same arguments and errors as
    `pack_segments`; the result also has `subtree_end`.
    """
    if routing_shape(segments, "pack_segment_tree") is not None:
        raise ValueError(
            "pack_segment_tree: the segments carry recorded MoE routing (routing replay); a "
            "merged prefix has one routing, the samplers' may differ: pack them flat "
            "(layout='flat'), or leave the routing out (RL: rl.moe.routing='recompute')"
        )
    lengths = packed_lengths(segments, seq_len, truncate, "pack_segment_tree")
    segments, table = resolve_constraints(
        segments, constraint_masks, min_masks, "pack_segment_tree"
    )
    task_index = {name: i for i, name in enumerate(task_names(segments))}
    features = feature_dtypes(segments, "pack_segment_tree")
    names = list(features)

    order = sorted(
        range(len(segments)), key=lambda i: (segments[i].tokens[: lengths[i]].tolist(), i)
    )
    rows: list[tuple[_Node, int]] = []  # (root, used tokens)
    root, used = _Node(None, -1), 0
    for i in order:
        keys = _path_keys(segments[i], lengths[i], names)
        extra = len(keys) - _shared_length(root, keys)
        if used + extra > seq_len:
            rows.append((root, used))
            root, used = _Node(None, -1), 0
            extra = len(keys)
        _insert(root, keys, segments[i], i)
        used += extra
    rows.append((root, used))

    n_rows = pad_rows(len(rows), min_rows, rows_multiple)
    out = empty_batch(n_rows, seq_len, features)
    # Padding tokens see only themselves.
    out["subtree_end"] = np.tile(np.arange(seq_len, dtype=np.int32), (n_rows, 1))
    for r, (root, _) in enumerate(rows):
        _layout(root, out, r, task_index, segments)
    return PackedBatch(
        **out,
        constraint_masks=table,
        num_tasks=pow2_bucket(len(task_index), min_tasks),
        num_segments=pow2_bucket(len(segments), min_segments),
    )
