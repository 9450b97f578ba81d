"""``python -m simulate`` = ``dplb-simulate``."""
import sys

from simulate.cli import main

sys.exit(main())
