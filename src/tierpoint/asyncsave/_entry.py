"""The worker process: ``python -c <worker._START> <socket fd> <trainer pid> <main>`` (``main``: 1
when the trainer's main thread started it, else 0), which ignores SIGINT and SIGTERM, then calls
:func:`main`.

When :func:`worker_main` returns (stopped, or its trainer is gone) every call it ran has returned
and made its files durable; the process ends at once instead of tearing the interpreter down (with
torch imported and at nice 19 that took seconds on a busy machine, and ``close()`` waited for it).
"""

import os
import sys
from multiprocessing.connection import Connection

from tierpoint.asyncsave.worker import worker_main


def main() -> None:
    parent = int(sys.argv[2]) if len(sys.argv) > 2 else None
    worker_main(Connection(int(sys.argv[1])), parent, len(sys.argv) < 4 or sys.argv[3] == "1")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
