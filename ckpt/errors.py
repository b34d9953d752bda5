"""The one error type users see.

Every failure caused by the input or the command line is a `CkptError`: the CLI prints its message as
one line and exits with code 2, and the output writer has already removed anything it started.
"""


class CkptError(Exception):
    """A user-facing failure; `str(err)` is the whole message."""

    exit_code = 2


def file_error(path, problem: str) -> CkptError:
    """An error about one input file, worded `PATH: problem`."""
    return CkptError(f"{path}: {problem}")


class ReportNotWritten(CkptError):
    """The command did its work (its output, if any, is published and stays), but the `--report` file
    could not be written: exit code 3, so a script never reads it as "exit 2, nothing written"."""

    exit_code = 3
