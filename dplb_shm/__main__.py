"""``python -m dplb_shm ...`` is ``dplb-shm ...`` (see :mod:`dplb_shm.cli`)."""
import sys

from dplb_shm.cli import main

sys.exit(main())
