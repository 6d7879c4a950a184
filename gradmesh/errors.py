"""The one exception type a user sees as a single line (the CLI prints it without a traceback)."""


class GradmeshError(RuntimeError):
    """A user-facing error (bad input, unreachable peer, failed rank) whose message is one line."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (library errors can run to many lines)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
