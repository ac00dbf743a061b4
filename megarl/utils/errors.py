"""Errors that cross a process boundary and reach the `megarl` command, importable without torch (the command
imports nothing heavy before its config is read: `megarl.controller.fork_server.start_early`)."""


class RankError(RuntimeError):
    """An exception raised on one rank of run_distributed, with that rank's traceback."""

    def __init__(self, rank: int, exc_type: str, message: str, tb: str):
        super().__init__(f"rank {rank} raised {exc_type}: {message}\n--- traceback of rank {rank} ---\n{tb}")
        self.rank = rank
        self.exc_type = exc_type
        self.remote_message = message
        self.remote_traceback = tb
