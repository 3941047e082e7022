"""Peer runners of benchmarks/bench_loop_race.py (each in its own venv), and their task."""
