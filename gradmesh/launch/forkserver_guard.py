"""Imported only as the first preload of a launcher's forkserver (`gradmesh.launch.forked`):
the server dies with the launcher that started it, SIGKILL included, and its forked workers,
which the kernel ends when their parent (this server) dies, with it. Without this the workers
would keep the server alive (they hold its "alive" pipe) after their launcher was killed."""

from __future__ import annotations

from gradmesh.runtime.process import stay_with_launcher

stay_with_launcher()
