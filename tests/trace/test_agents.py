"""Agent labels (`trace.agents`): one pattern language for every filter over episodes."""

import pytest

from ac2_jax.trace import (
    SUBAGENT_WILDCARD,
    agent_group,
    agent_matches,
    check_agent_pattern,
    is_subagent,
)


def test_labels_groups_and_matches():
    assert is_subagent("subagent:helper") and not is_subagent("subagent:")
    assert not is_subagent("subagent") and not is_subagent("main")
    assert [agent_group(a) for a in ("main", "compactor", "subagent:a", "subagent:b")] == [
        "main", "compactor", "subagent", "subagent"]
    assert agent_matches("subagent:a", SUBAGENT_WILDCARD) and agent_matches("main", None)
    assert agent_matches("main", ("compactor", "main")) and agent_matches("main", "main")
    assert not agent_matches("subagent:", SUBAGENT_WILDCARD)  # no name: not a subagent
    assert not agent_matches("mainx", "main") and not agent_matches("compactor", ())


@pytest.mark.parametrize("bad, match", [("", "not an agent label"), (3, "not an agent label"),
                                        ("sub*", "only wildcard"), ("*", "only wildcard"),
                                        ("subagent", "did you mean 'subagent:\\*'"),
                                        ("subagent:", "did you mean")])
def test_bad_patterns_are_refused_with_how_to_write_them(bad, match):
    with pytest.raises(ValueError, match=match):
        check_agent_pattern(bad, "somewhere")
    assert check_agent_pattern("subagent:*", "x") == "subagent:*"
