"""Support code shared by every phase: process groups, worlds of processes, models, data.

Nothing here is an exercise. Templates, solutions, tests, benchmarks and notebooks all import
it from this one place.
"""
