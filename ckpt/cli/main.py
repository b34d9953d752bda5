"""The `ckpt` group and how a command is run: signals become one KeyboardInterrupt, a CkptError one
`error:` line with its exit code, `--report FILE.json` is written at the end. The commands live one module
each beside this one (`ckpt/cli/convert.py` ... `lora.py`, `batch.py`); their options and checks in
`options.py`, the report in `report.py`."""

from __future__ import annotations

import signal
import sys

import click

from ckpt import __version__
from ckpt.cli.options import OneLineGroup
from ckpt.cli.report import finish as finish_report, reset as reset_report
from ckpt.errors import CkptError, ReportNotWritten


@click.group(cls=OneLineGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ckpt")
def cli():
    """Convert, decode and merge checkpoints tensor by tensor, with bounded memory."""


from ckpt.cli.batch import batch  # noqa: E402  (each command's module imports only click and light modules)
from ckpt.cli.convert import convert  # noqa: E402
from ckpt.cli.dequant import dequant  # noqa: E402
from ckpt.cli.inspect import inspect  # noqa: E402
from ckpt.cli.lora import lora  # noqa: E402
from ckpt.cli.merge import merge  # noqa: E402
from ckpt.cli.merge_lora import merge_lora  # noqa: E402

for _command in (convert, dequant, inspect, merge, merge_lora, batch, lora):
    cli.add_command(_command)

# How each command writes GGUF: what the refusal of `-o NAME.gguf` without it says to add
# (`ckpt.io.output.check_container`). A command not named here never writes GGUF, and refuses such an -o at once.
for _command, _how in ((convert, "--to gguf-TYPE"), (dequant, "--to gguf-TYPE"),
                       (merge_lora, "--to gguf-TYPE (or --keep-format on a GGUF base)"),
                       (merge, "--to gguf-TYPE (or --keep-format on a GGUF reference)"),
                       (batch.commands["convert"], "--to gguf-TYPE"), (batch.commands["merge-lora"], "--to gguf-TYPE"),
                       (lora.commands["convert"], "--format gguf --base HF_FOLDER")):
    _command.writes_gguf = _how


class _Signals:
    """SIGINT/SIGTERM become one KeyboardInterrupt while a command runs (the writer then removes its temp
    output); any later one is only recorded. `seen` is set either way, so an interrupt that a library
    turned into another exception (numpy's ImportError during start-up) still reads as an interrupt."""

    def __init__(self):
        self.active, self.seen = True, False

    def __call__(self, signum, frame):
        self.seen = True
        if self.active:
            self.active = False  # at most once: a second signal never interrupts the cleanup of the first
            raise KeyboardInterrupt


def _published(since: int) -> list:
    """What the output writer published since `since` (ckpt.io.publish is loaded only by writing commands)."""
    publish = sys.modules.get("ckpt.io.publish")
    return publish.PUBLISHED[since:] if publish is not None else []


def _interrupted(since: int) -> None:
    done = _published(since)
    if done:
        click.echo(f"interrupted after writing {', '.join(str(p) for p in done)} (complete)", err=True)
    else:
        click.echo("interrupted: nothing was written", err=True)
    sys.exit(130)


def _dispatch(argv, handler: _Signals, since: int) -> None:
    reset_report(argv)
    try:
        cli.main(args=argv, prog_name="ckpt", standalone_mode=False)
        handler.active = False
        finish_report(0)  # --report FILE.json (a failure to write it is the CkptError below)
    except CkptError as e:
        if not isinstance(e, ReportNotWritten):  # else the command succeeded and only its report failed
            try:
                finish_report(e.exit_code, str(e), getattr(e, "report", None))
            except CkptError:  # the command's own error is the one line to print
                pass
        click.echo(f"error: {e}", err=True)
        sys.exit(e.exit_code)
    except (click.exceptions.Abort, KeyboardInterrupt):
        _interrupted(since)
    except click.ClickException as e:
        e.show()
        sys.exit(2)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except Exception:
        if handler.seen:  # the interrupt came back as another exception (an import failing half-way)
            _interrupted(since)
        raise
    if handler.seen:  # arrived after the command finished: all of it is done, and we were asked to stop
        _interrupted(since)


def main(argv=None):
    """The console script (argv None: the process ends when this returns), or an in-process call."""
    handler = _Signals()
    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    since = len(_published(0))
    try:
        try:
            _dispatch(argv, handler, since)
        except KeyboardInterrupt:  # the one interrupt landed inside one of _dispatch's own handlers
            _interrupted(since)
    finally:
        handler.active = False
        if argv is None:  # exiting: a late signal must not kill the interpreter's shutdown without a word
            for s in old:
                signal.signal(s, signal.SIG_IGN)
        else:
            for s, h in old.items():
                signal.signal(s, h)


if __name__ == "__main__":
    main()
