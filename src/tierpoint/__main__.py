"""``python -m tierpoint``: the ``tierpoint`` command, as ``python -m tierpoint.cli`` runs it.

Call order: runs :func:`tierpoint.cli.main` with ``sys.argv`` and exits with its status.
Invariants: nothing else (neither the package's import nor ``tierpoint.cli`` brings torch).
"""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
