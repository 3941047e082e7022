"""The one serving core every request API goes through.

A request API turns its body into a `requests.ChatRequest` (validated by `schemas`, the
one validation layer), and `generation` runs it: the prompt (`splice`: earlier turns'
sampled ids reused), the grammar (`structured`), the samples (`sample_run`), the answer
(`chat.Choice`) and its recording on the rollout's trace; streamed answers go through
`stream_generation` and `streaming`. `errors` holds `APIError` and each API's error
shape. OpenAI's Chat Completions is the core's own request and answer shape, so its
routes (`generation.install_generation_routes`) live here; the other APIs translate
into it (`ac2_jax.serving.apis`).
"""
