"""The embedded sampling engine: `JaxSampler` over a Flax decoder in this process.

`jax_sampler` (the `Sampler`: requests in, results out), `worker` (the device thread
that admits requests into cache rows and runs the decode chunks), `batching` (the host
bookkeeping of those rows: `SlotTable`, prefix reuse, occupancy) and `decode_loop` (the
jitted prefill / decode / sampling steps). `ac2_jax.sampling` exports `JaxSampler`.
"""
