"""Real-size models without a download: the Qwen3 presets (`experiments/real_size/qwen3.py`) and
random HF checkpoints of their shapes (`checkpoint`), for the real-size benchmarks.
"""
