"""The one exception type a user sees as a single line (the CLI prints it without a traceback)."""


class GradmeshError(RuntimeError):
    """A user-facing error (bad input, unreachable peer, failed rank) whose message is one line."""
