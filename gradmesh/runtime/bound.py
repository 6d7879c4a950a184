"""A process that ends with the one that started it, and the shim that makes any command one.

`gradmesh run` starts every worker command it does not fork (a user's torch script, a shell
script, any program; gradmesh's own where it cannot fork them) as `python -I -S
.../gradmesh/runtime/bound.py PROGRAM ARGS...`: the shim asks the kernel to SIGKILL it when the
launcher dies (SIGKILL included, which the launcher cannot pass on), checks that the launcher
is still its parent, puts back the signals Python ignores (SIGPIPE, SIGXFSZ: an exec would
pass them on ignored), then replaces itself with the command: the kernel keeps the request
across exec (not for set-user-ID or file-capability programs, which it clears it for), and
the pid, exit code and signals are the command's. Before it, a plain torch script's workers
outlived a launcher killed by SIGKILL (as torchrun's do); a script that calls `gradmesh.init`
binds itself too (`process.bind_to_launcher`).

Run by its path in isolated mode, not as a module: it imports only the standard library
(gradmesh's package would cost its imports, and `-I -S` keep the PYTHONPATH and site hooks
out), so a worker pays one bare Python start, some 20 ms.
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
    for name in ("SIGPIPE", "SIGXFSZ"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:  # a shell's codes: 127 not found, 126 found but not runnable
        print(f"gradmesh run: cannot start {argv[0]}: {exc.strerror}", file=sys.stderr)
        os._exit(127 if isinstance(exc, FileNotFoundError) else 126)


if __name__ == "__main__":
    main(sys.argv[1:])
