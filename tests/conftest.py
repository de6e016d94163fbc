"""Shared test set-up: tests import the multi-rank helper as ``from _dist import run_ranks``."""

import logging

logging.getLogger("tierpoint").setLevel(logging.DEBUG)
