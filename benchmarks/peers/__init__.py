"""Peer runners of benchmarks/bench_loop_race.py (each runs in its own venv) and the task they share."""
