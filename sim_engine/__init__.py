"""DPLB's built-in simulated inference engine: a vLLM-like OpenAI server that needs no GPU.

Run ``dplb-sim-engine --port P`` (or ``python -m sim_engine --uds PATH``). The engine core
(:mod:`sim_engine.engine`) is pure and steppable; :mod:`sim_engine.runner` drives it in scaled real
time; :mod:`sim_engine.server` serves it over HTTP. Tokens are whitespace-separated words.
"""

__version__ = "0.1.0"
