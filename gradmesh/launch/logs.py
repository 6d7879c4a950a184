"""Log levels of the launcher process; this module must not import torch."""

import os

CPP_LOG_ENV = "TORCH_CPP_LOG_LEVEL"
WORKER_CPP_LOG_ENV = "GRADMESH_WORKER_TORCH_CPP_LOG_LEVEL"


def quiet_cpp_logs() -> None:
    """Call before torch loads in the launcher process.

    c10d's C++ logging prints stack frames when a store connection fails: too much for a launcher
    that reports each failure in one line. The workers keep the user's level.
    """
    os.environ.setdefault(WORKER_CPP_LOG_ENV, os.environ.get(CPP_LOG_ENV, "WARNING"))
    os.environ[CPP_LOG_ENV] = "FATAL"
