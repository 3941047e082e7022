"""Coding: write a small Python function that passes hidden tests.

Kept import-free (see examples/__init__.py).
"""
