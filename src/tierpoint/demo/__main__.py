"""``python -m tierpoint.demo``: the demo job (see :mod:`tierpoint.demo`)."""

import sys

from . import main

sys.exit(main())
