"""Samplers over servers: `SGLangSampler` (a client of an SGLang server's native API, or
of `python -m ac2_jax.serving.backend`; `_sglang_lora` holds its adapter calls) and
`FleetSampler` (one `Sampler` over N backend samplers, `fleet`). `ac2_jax.sampling`
exports both.
"""
