"""``python -m tierpoint.cli``: the ``tierpoint`` command (:func:`tierpoint.cli.main`).

Call order: runs :func:`~tierpoint.cli.main` with ``sys.argv`` and exits with its status.
Invariants: importing it does nothing else (no torch: ``--help`` answers at once).
"""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
