"""Benchmarks for ortfx: backend comparison, wrapper overhead, ORT session settings, profiles.

Run from the repository root, e.g. ``python -m bench.compare --models all``.
"""
