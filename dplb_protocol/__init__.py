"""What every DPLB process agrees on, below all of them: the wire format of a request and of an
error (:mod:`dplb_protocol.wire`) and the limits both sides of a drain keep
(:mod:`dplb_protocol.limits`).

The router, the picker, the worker agent, the simulator and the benchmarks import it; it imports
no other DPLB package (tests/test_architecture.py).
"""
