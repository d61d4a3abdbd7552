"""Measuring: per-layer costs, saved-activation bytes, device timing, call timing and the step's timeline.

Torch only, and nothing else of the engine's: the planner and the benchmarks measure with it too.
"""
