"""TraceRecorder: turns a stream of completions into append-only episodes.

A harness never says where an episode starts. A completion whose prompt
extends one of the agent's episodes token-for-token is appended to it (its new
prompt tokens with mask 0, its output with mask 1). Anything else (compaction,
a fork, an edited or transient message, a second response to the same
prompt) starts a new episode.

With `delta_messages=True` (the endpoint), each completion keeps only the
messages its request added to the episode's previous request (see
`Completion.to_delta`), so stored traces grow linearly over turns.
"""

from __future__ import annotations

import threading

from ac2_jax.trace.types import Completion, Episode, Trace


def _extends(prompt: list[int], tokens: list[int]) -> bool:
    return len(prompt) >= len(tokens) and prompt[: len(tokens)] == tokens


class TraceRecorder:
    """Records completions into a Trace. Thread-safe."""

    def __init__(self, trace: Trace, delta_messages: bool = False):
        self.trace = trace
        self.delta_messages = delta_messages
        self._last_messages: dict[int, list | None] = {}  # id(episode) -> its last full list
        self._lock = threading.Lock()

    def record(self, agent: str, completion: Completion) -> Episode:
        """Adds `completion` to `agent`'s episodes; returns the episode used."""
        with self._lock:
            episode = None
            # Newest first, so a continued branch wins over older ones.
            for ep in reversed(self.trace.episodes):
                if ep.agent == agent and _extends(completion.prompt_ids, ep.token_ids):
                    episode = ep
                    break
            if episode is None:
                episode = Episode(agent=agent)
                self.trace.episodes.append(episode)
            new_prompt = completion.prompt_ids[len(episode.token_ids) :]
            episode.token_ids.extend(new_prompt)
            episode.loss_mask.extend([0] * len(new_prompt))
            episode.sampler_logprobs.extend([0.0] * len(new_prompt))
            episode.token_ids.extend(completion.output_ids)
            episode.loss_mask.extend([1] * len(completion.output_ids))
            episode.sampler_logprobs.extend(float(x) for x in completion.output_logprobs)
            if self.delta_messages:
                full = completion.messages
                completion.to_delta(self._last_messages.get(id(episode)))
                self._last_messages[id(episode)] = full
            episode.completions.append(completion)
            return episode
