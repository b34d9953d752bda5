"""The output side: what every writing command (convert, dequant, merge-lora, merge, and `ckpt batch`'s forms of
them) writes, one registry that the CLI's choices and help and every command read, so that a target is spelt
in one place and each command takes every target that makes sense for it (`choose`, `plan_output`).

Each module of this package (but `base`) is one kind of target and declares, without importing torch
(`ckpt --help` and option parsing read this registry, and must stay cheap):

    ORDER    where its names come in the CLI's choices, the help and the messages that list targets
    TARGETS  its `Target`s (base.py): name, default-name suffix, file suffix, option checks, planning
    HELP     its clause of --to's help text, or "" (it is described by another kind's clause)
    PREFIX   (optional) a name prefix the kind owns, with `claim(name) -> Target` for names under it
             that are not registered, so the kind refuses them in its own words (`gguf-q4_k_m`: no
             encoder) instead of a generic "unknown target"

Adding a target is adding a module here: modules are found by listing the package (`ckpt.registry`), not
by a table, and their heavy work (torch, encoders) is imported inside the methods that plan.
"""

from __future__ import annotations

from ckpt.errors import CkptError
from ckpt.targets.base import Target
from ckpt.registry import entry_modules

_KINDS: list | None = None


def kinds() -> list:
    """The target-kind modules of this package, in ORDER (found once, then kept)."""
    global _KINDS
    if _KINDS is None:
        _KINDS = sorted(entry_modules(__name__, __path__, "TARGETS"), key=lambda m: (m.ORDER, m.__name__))
    return _KINDS


def all_targets() -> list[Target]:
    return [t for k in kinds() for t in k.TARGETS]


def names(batch: bool | None = None) -> list[str]:
    """Every --to name, in order; batch=True: those `ckpt batch convert` offers (outputs it can name)."""
    return [t.name for t in all_targets() if batch is None or t.in_batch == batch]


def prefixes() -> tuple[str, ...]:
    return tuple(k.PREFIX for k in kinds() if getattr(k, "PREFIX", None))


def get(name: str | None) -> Target | None:
    """The target --to NAME names: a registered one, else one a kind claims by prefix (which refuses
    it when checked), else None (unknown)."""
    if name is None:
        return None
    for t in all_targets():
        if t.name == name:
            return t
    for k in kinds():
        if getattr(k, "PREFIX", None) and name.startswith(k.PREFIX):
            return k.claim(name)
    return None


def resolve(name: str | None, scaled: bool = False) -> Target | None:
    """`get`, then the target's --scaled variant where it has one (fp8_e4m3fn); no name: keep each
    tensor's dtype (convert --layout alone)."""
    if name is None:
        from ckpt.targets.casts import KEEP

        t = KEEP
    else:
        t = get(name)
    if t is not None and scaled and t.scaled_variant is not None:
        return t.scaled_variant
    return t


def canonical(name: str | None) -> str | None:
    """The name a target records in its outputs' `ckpt_operation`: an alias (`gguf-q4_k`) as the name it stands
    for (`gguf-q4_k_m`), so that both write the same bytes; an unknown name as given."""
    t = get(name)
    return t.canonical if t is not None else name


def choose(opts, default: Target) -> Target:
    """The target a command writes: --keep-format (the input's own encoding), else --to NAME (its --scaled variant
    where it has one), else the command's `default` (`ckpt.targets.casts.Natural`). An unknown name is refused."""
    if getattr(opts, "keep_format", False):
        if opts.to is not None:
            raise CkptError(f"--to {opts.to} and --keep-format: choose one (--keep-format writes every tensor in "
                            "the input's own stored dtype or quantized format)")
        from ckpt.targets.keep_format import KEEP_FORMAT

        return KEEP_FORMAT
    if opts.to is None:
        t = default
    else:
        t = get(opts.to)
        if t is None:
            raise CkptError(f"--to {opts.to}: unknown target (choose {', '.join(unprefixed_names())})")
    if opts.scaled and t.scaled_variant is not None:
        return t.scaled_variant
    return t


def plan_output(target: Target, ckpt, views, opts, report, file_format: str, operation: str):
    """The plan of every writing command: the target's options checked, its plan made from the command's views,
    and a note per component whose stored encoding was decoded."""
    from ckpt.run import decoded_notes

    target.check(opts)
    plan = target.plan(ckpt, views, opts, report, file_format, operation)
    if target.decodes:
        plan.notes += decoded_notes(ckpt, views)
    return plan


def unprefixed_names() -> list[str]:
    """The names a generic "unknown target" message lists (a prefix's kind refuses its own names)."""
    return [n for n in names() if not n.startswith(prefixes())] if prefixes() else names()


def help_text(batch: bool) -> str:
    """--to's help: the clauses of the kinds whose targets `ckpt batch` offers, one sentence; then (the
    single command only) the others' own sentences."""
    def offered(k, in_batch):
        return any(t.in_batch == in_batch for t in k.TARGETS)

    text = ", or ".join(k.HELP for k in kinds() if k.HELP and offered(k, True)) + "."
    if not batch:
        text = " ".join([text, *(k.HELP for k in kinds() if k.HELP and offered(k, False) and not offered(k, True))])
    return text
