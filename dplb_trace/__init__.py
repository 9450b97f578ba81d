"""Traces and their statistics, below the benchmarks and the simulator: the Mooncake trace
shipped with DPLB and its reader (:mod:`dplb_trace.mooncake`: requests, prompt text that keeps the
trace's prefix sharing, conversations), the error a bad trace line raises
(:mod:`dplb_trace.errors`) and the percentile every report uses (:mod:`dplb_trace.stats`).

``bench`` (``dplb-replay``, the harness) and ``simulate`` (``dplb-simulate``) import it; it
imports no other DPLB package (tests/test_architecture.py).
"""
