"""Shared test set-up: every test module can ``from _dist import run_ranks``."""

import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
logging.getLogger("tierpoint").setLevel(logging.DEBUG)
