"""``python -m tierpoint``: the ``tierpoint`` command, as ``python -m tierpoint.cli`` runs it.

Call order: runs :func:`tierpoint.cli.main` with ``sys.argv`` and exits with its status.
Invariants: nothing else (the package's import brings torch; ``tierpoint.cli`` alone does not).
"""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
