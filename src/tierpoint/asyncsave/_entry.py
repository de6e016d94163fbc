"""Entry point of the worker process: ``python -m tierpoint.asyncsave._entry <socket fd>``."""

import sys
from multiprocessing.connection import Connection

from tierpoint.asyncsave.worker import worker_main

if __name__ == "__main__":
    worker_main(Connection(int(sys.argv[1])))
