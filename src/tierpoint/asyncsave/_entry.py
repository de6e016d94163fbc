"""The worker process: ``python -m tierpoint.asyncsave._entry <socket fd> <trainer pid>``."""

import sys
from multiprocessing.connection import Connection

from tierpoint.asyncsave.worker import worker_main

if __name__ == "__main__":
    worker_main(Connection(int(sys.argv[1])), int(sys.argv[2]) if len(sys.argv) > 2 else None)
