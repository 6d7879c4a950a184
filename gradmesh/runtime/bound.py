"""A process that ends with the one that started it, and the shim that makes any command one.

`gradmesh run` starts every command that is not gradmesh's own (a user's torch script, a shell
script, any program) as `python .../gradmesh/runtime/bound.py PROGRAM ARGS...`: the shim asks the
kernel to SIGKILL it when the launcher dies (SIGKILL included, which the launcher cannot pass
on), checks that the launcher is still its parent, then replaces itself with the command: the
kernel keeps the request across exec, and the pid, exit code and signals are the command's.
Before it, a plain torch script's workers outlived a launcher killed by SIGKILL (as torchrun's
do); a script that calls `gradmesh.init` binds itself (`process.bind_to_launcher`).

Run by its path, not as a module: it imports only the standard library (gradmesh's package
would cost its imports), so a worker pays one bare Python start, some 20 ms.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

LAUNCHER_PID_ENV = "GRADMESH_LAUNCHER_PID"
"""Set by `gradmesh run` (and a ps worker's supervisor) to its own pid: the process a worker
must not outlive."""
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when the process that started it dies."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def main(argv: list[str]) -> None:
    """`bound.py PROGRAM ARGS...`: PROGRAM (found on the PATH) in this process, bound to the
    launcher named by the environment."""
    die_with_parent()
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher and str(os.getppid()) != launcher:  # it died before the kernel watched
        print(f"gradmesh run: the launcher (pid {launcher}) is gone; not starting", file=sys.stderr)
        os._exit(1)
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        print(f"gradmesh run: cannot start {argv[0]}: {exc.strerror}", file=sys.stderr)
        os._exit(127)


if __name__ == "__main__":
    main(sys.argv[1:])
