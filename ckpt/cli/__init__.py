"""The `ckpt` command line (console script `ckpt = ckpt.cli:main`, or `python -m ckpt.cli`): one module per
command or command group, sharing `options` (the options and the checks made as the command line is read)
and `report` (what a command says, and `--report FILE.json`)."""

from ckpt.cli.main import cli, main

__all__ = ["cli", "main"]
