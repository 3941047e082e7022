"""Agent labels: who made an episode, and the one way to match them.

An episode's `agent` is "main", "compactor" or "subagent:<name>". Every filter
over labels (RL's `BatchConfig.train_agents`, distillation's `agents` and
per-agent hint configs) takes patterns of one language: an exact label, or
`SUBAGENT_WILDCARD` ("subagent:*", every `subagent:<name>`); anything else is
refused with a message that says how to write it.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "COMPACTOR",
    "MAIN",
    "SUBAGENT_PREFIX",
    "SUBAGENT_WILDCARD",
    "agent_group",
    "agent_matches",
    "check_agent_pattern",
    "is_subagent",
]

MAIN = "main"
COMPACTOR = "compactor"
SUBAGENT_PREFIX = "subagent:"
SUBAGENT_WILDCARD = "subagent:*"


def is_subagent(label: str) -> bool:
    """Whether `label` is a `subagent:<name>` label (a name after the colon)."""
    return label.startswith(SUBAGENT_PREFIX) and len(label) > len(SUBAGENT_PREFIX)


def agent_group(label: str) -> str:
    """The metrics group of a label: "subagent" for `subagent:<name>`, else the label."""
    return "subagent" if is_subagent(label) else label


def check_agent_pattern(pattern: object, where: str) -> str:
    """`pattern` if it is an agent label or "subagent:*"; else a ValueError naming `where`."""
    how = (
        f'use an agent label ("{MAIN}", "{COMPACTOR}", "subagent:<name>") or '
        f'"{SUBAGENT_WILDCARD}" (every subagent)'
    )
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"{where}: {pattern!r} is not an agent label: {how}")
    if "*" in pattern and pattern != SUBAGENT_WILDCARD:
        raise ValueError(f"{where}: {pattern!r}: the only wildcard is {SUBAGENT_WILDCARD!r}; {how}")
    if pattern in ("subagent", SUBAGENT_PREFIX):
        raise ValueError(
            f"{where}: {pattern!r} names no agent; did you mean "
            f"{SUBAGENT_WILDCARD!r} (every subagent)?"
        )
    return pattern


def agent_matches(label: str, patterns: str | Iterable[str] | None) -> bool:
    """Whether `label` is matched by `patterns` (one or several; None: every label)."""
    if patterns is None:
        return True
    for p in (patterns,) if isinstance(patterns, str) else patterns:
        if label == p or (p == SUBAGENT_WILDCARD and is_subagent(label)):
            return True
    return False
