"""``python -m sim_engine`` == ``dplb-sim-engine``."""

from sim_engine.server import main

if __name__ == "__main__":
    raise SystemExit(main())
