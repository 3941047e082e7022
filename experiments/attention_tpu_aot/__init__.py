"""The TPU attention kernel compiled ahead of time for a TPU topology on a CPU host, at a real
model's attention shape (issue 69; `python -m experiments.attention_tpu_aot`).
"""
