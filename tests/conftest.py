"""Shared test set-up. Multi-rank tests use :func:`tierpoint.spawn.run_ranks`."""

import logging

logging.getLogger("tierpoint").setLevel(logging.DEBUG)
