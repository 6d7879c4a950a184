"""How a worker process ends: after `shutdown()`, by `exit_process`; when its launcher stops it,
with a moment to report the failure that stopped the job.

When one rank dies, torch's elastic agent sends SIGTERM to the others within a tenth of a second.
The survivors are usually about to raise the failure from their own side, naming the operation
and the peer ("pipeline stage 0 forward/backward (step 3): receive from rank 1 failed"): the line
that says what the job was doing. On a busy machine SIGTERM's default action killed them before
they printed it. With `finish_reports_on_stop()` installed, SIGTERM gives a worker up to
`STOP_GRACE_S` to end by itself (report, exit with its own code); then it ends by SIGTERM. A
watcher thread learns of the signal through `signal.set_wakeup_fd`, which Python's C-level
handler writes to even while the main thread is blocked in a native call (a collective waiting
on a peer), where no Python handler could run.

Ending "by SIGTERM" restores the default action through libc and re-sends the signal, so the
launcher still sees the exit status of a signalled process (-15) and ranks it after the rank that
failed first. Torch-free: the standard library does all of it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from typing import Any, NoReturn

from gradmesh.errors import PEER_FAILED_EXIT

PEER_GRACE_S = 3.0
"""How long a rank that stopped on a peer's failure lingers before exiting, so that the launcher
sees the rank that caused it end first and names that one (1 s was too short on a busy CI
machine, where the failing rank's own exit took longer: the launcher named the peer's code 75);
the launcher's SIGTERM ends the pause at once, so a restart does not wait for it."""
_leaving: list[int] = []
"""The exit code of a rank in that pause (empty before it)."""


class Finished(BaseException):
    """Raised by `exit_process(0)` in a worker forked by its launcher (`return_on_success`):
    its entry function returns, which is how torch's agent learns it ended well. A
    BaseException, so that no `except Exception` on the way takes it for a failure."""


_return_on_success: list[bool] = []


def return_on_success() -> None:
    """This process is a forked worker (`gradmesh.launch.forked`): `exit_process(0)` raises
    `Finished` rather than leaving the process."""
    _return_on_success.append(True)


def exit_process(code: int) -> NoReturn:
    """End a worker process of gradmesh's own entry points after `shutdown()`: flush output and
    leave without running C++ static destructors, one of which (in a c10d/Gloo thread) aborted
    now and then at interpreter exit ("terminate called without an active exception"). A
    forked worker's success returns to its entry function instead (`Finished`), whose process
    then ends the same way (multiprocessing leaves by os._exit too)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if code == 0 and _return_on_success:
        raise Finished
    if code == PEER_FAILED_EXIT:
        _leaving.append(code)  # SIGTERM ends the pause: the launcher has seen the failure
        time.sleep(PEER_GRACE_S)
    os._exit(code)


STOP_GRACE_S = 4.0
"""The longest a worker lingers after SIGTERM; more than `PEER_GRACE_S`."""


def _end_by_sigterm() -> None:
    """Die of SIGTERM's default action, from any thread (`signal.signal` is main-thread only,
    libc's `signal` is not)."""
    sys.stderr.flush()
    ctypes.CDLL(None).signal(signal.SIGTERM, 0)  # 0 is SIG_DFL
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(1.0)  # the signal is delivered before this returns
    os._exit(128 + signal.SIGTERM)


def _on_sigterm(_signum: int, _frame: Any) -> None:
    """A rank pausing after its report (`exit_process`) leaves now with its code, as it did
    when SIGTERM killed it (a job's restart waits for it); any other goes on, and the watcher
    thread ends it once the grace period is over."""
    if _leaving:
        os._exit(_leaving[0])


def _watch(fd: int, grace_s: float) -> None:
    while True:
        try:
            got = os.read(fd, 64)
        except OSError:
            return
        if not got:
            return
        if int(signal.SIGTERM) in got:
            time.sleep(grace_s)
            _end_by_sigterm()


def finish_reports_on_stop(grace_s: float = STOP_GRACE_S) -> bool:
    """Install the SIGTERM handling above; True where it was installed. Nothing is changed off
    the main thread, where SIGTERM already has a handler, or where another wakeup fd (an asyncio
    loop's) is set."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not (
        threading.main_thread()
    ):
        return False
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return False
    read, write = os.pipe()
    os.set_blocking(write, False)
    previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    if previous != -1:
        signal.set_wakeup_fd(previous)
        os.close(read)
        os.close(write)
        return False
    signal.signal(signal.SIGTERM, _on_sigterm)
    threading.Thread(
        target=_watch, args=(read, grace_s), name="gradmesh-stop-grace", daemon=True
    ).start()
    return True


INTERRUPTED_EXIT = 128 + signal.SIGINT
"""A process's exit code after Ctrl-C, as a shell's."""


def _interrupt_once(_signum: int, _frame: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def interrupt_once() -> None:
    """SIGINT raises KeyboardInterrupt once, then is ignored: Ctrl-C reaches every process of
    the terminal's group and the launcher passes its own on, so a second one would interrupt
    the process's ending (a traceback in the except block that ends it quietly)."""
    if threading.current_thread() is not threading.main_thread():  # a Ray actor's thread
        return
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where ignored
        signal.signal(signal.SIGINT, _interrupt_once)
