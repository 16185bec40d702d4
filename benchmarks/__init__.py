"""Benchmarks: a timed, checked shape grid comparing jflash with its peers.

Run ``python -m benchmarks.grid --help`` from the repository root; see
``benchmarks/README.md``.
"""
