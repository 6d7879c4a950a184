"""Imported only as the first preload of a launcher's forkserver (`gradmesh.launch.forked`):
the server dies with the launcher that started it, SIGKILL included, and its forked workers,
which the kernel ends when their parent (this server) dies, with it. Without this the workers
would keep the server alive (they hold its "alive" pipe) after their launcher was killed."""

from __future__ import annotations

import os

from gradmesh.runtime.process import LAUNCHER_PID_ENV, die_with_parent

die_with_parent()
if str(os.getppid()) != os.environ.get(LAUNCHER_PID_ENV):  # gone before the kernel watched it
    os._exit(1)
