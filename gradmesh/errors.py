"""The exceptions a user sees as a single line (the CLI and the workers print them without a
traceback), and the exit code that marks a rank which failed only because another one did."""

import re
import traceback


class GradmeshError(RuntimeError):
    """A user-facing error (bad input, unreachable peer, failed rank) whose message is one line."""


class GradmeshValueError(GradmeshError, ValueError):
    """A user-facing error about a bad argument where Horovod raises `ValueError` (a repeated
    operation name, bad `named_parameters`): scripts that catch `ValueError` catch it too."""


class PeerFailure(GradmeshError):
    """A collective could not complete because of other ranks: one left, fell silent past the
    timeout, or brought a different tensor. The message names this rank, the operation with its
    sequence number, and the peer(s) waited for."""


PEER_FAILED_EXIT = 75
"""Exit code of a worker that stopped on a `PeerFailure`: the launcher reports another rank's
failure first when there is one, since this rank is a casualty, not the cause."""


_SOURCE = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*")


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (library errors can run to many lines), without
    a C++ source location in front or Gloo's advice behind."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    return str(_SOURCE.sub("", line)).split(". This is typically caused")[0]


def on_rank(rank: int | str, exc: BaseException) -> str:
    """`exc`'s message as a line about `rank` ('rank 3: ...'), without naming the rank twice."""
    text = str(exc)
    return text if text.startswith(f"rank {rank}:") else f"rank {rank}: {text}"


_TRANSPORT = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Timed out")


def torch_collective_failure(exc: BaseException, rank: int | str) -> PeerFailure | None:
    """A collective torch made on gradmesh's behalf (FSDP2's at ZeRO stages 2 and 3, the
    ZeroRedundancyOptimizer's at stage 1) that failed because a peer left or fell silent, as
    one line naming this rank and the operation, the way gradmesh's own collectives report it
    (`PeerFailure`); None for any other error. The operation is the innermost of torch's
    collective functions on the traceback."""
    if isinstance(exc, GradmeshError) or not isinstance(exc, RuntimeError):
        return None
    if not any(words in str(exc) for words in _TRANSPORT):
        return None
    frames = [frame.f_code for frame, _ in traceback.walk_tb(exc.__traceback__)]
    ops = [c.co_name for c in frames if c.co_filename.endswith("distributed_c10d.py")]
    if not ops:
        return None
    owner = (
        " of FSDP2 (--zero-stage 2 or 3)"
        if any("_fully_shard" in c.co_filename for c in frames)
        else ""
    )
    return PeerFailure(f"rank {rank}: {ops[-1]}{owner} failed: {first_line(exc)}")
