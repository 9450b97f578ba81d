"""Experiments that patch the product at run time to try an idea before it is built into it (not
installed: ``setup.cfg`` packages none of this; run from a checkout, ``python -m
prototypes.<name>``). Each module says what it patches and where its results are
(``bench/results/``)."""
