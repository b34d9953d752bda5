"""The vocabulary every family module is written in: `Family`, `Signature`, `Pair`, `Alias`, `Transform`,
and small helpers over key sets. Pure data and functions over names and shapes; nothing here reads tensors
(`Transform` acts on the tensors a command hands it).

A *layout* is a naming scheme of one model: "original" (the reference implementation's names, what
ComfyUI single files, BFL/SAI/Wan releases, kohya/musubi use) or "diffusers" (the diffusers model
class's names, what diffusers, PEFT and SimpleTuner use). Families with a single naming (T5, LLMs) have
layout None.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Callable, Iterable

from ckpt.report import plural
from ckpt.lazy import torch

Shapes = dict[str, tuple[int, ...]]

ORIGINAL, DIFFUSERS = "original", "diffusers"
LAYOUTS = (ORIGINAL, DIFFUSERS)

# Parameter suffixes that name a module's main tensor; a LoRA module name is the key without them.
PARAM_SUFFIXES = (".weight", ".scale")

SEP = r"[._]"


class Transform(StrEnum):
    """What turns a tensor of one layout into its counterpart in the other, beyond renaming and row slices:
    the one definition every command uses (layout conversion, merging, LoRA extraction and conversion),
    so none re-derives an inverse, a shape or a factor rule of its own.

    Family modules declare the forward direction (original -> diffusers), by name: `Pair(...,
    transform="swap_halves")`; `Pair` and `Alias` turn the name into the member once. A member is a
    `str` equal to its name (`Transform.TRANSPOSE == "transpose"`, same hash), so the spelling in tables,
    messages and JSON stays what it was.

    - SWAP_HALVES: the two halves of the rows exchanged (adaLN shift/scale vs scale/shift order); its
      own inverse. Needs an even number of rows.
    - TRANSPOSE: a 2-D tensor transposed (OpenCLIP `text_projection`); its own inverse; not row-wise, so
      a transposed tensor is read whole.
    - SQUEEZE: a 1x1 conv kernel [o, i, 1, 1...] as a linear weight [o, i] (VAE attention); UNSQUEEZE,
      its inverse, gives [o, i, 1, 1] back. Row-local: row r of the result is row r of the input, so it
      applies band by band.
    - SIX_ROWS: a 1-D vector of six modulation vectors [6 * w] as diffusers' [6, w] `scale_shift_table`
      (Krea 2 stores each block's table flattened); FLATTEN, its inverse, gives the 1-D vector back. The
      same elements in the same order, regrouped into other rows: neither row-local nor row-keeping, so
      such a tensor (a few kilobytes) is read whole.

    Torch is imported only where a tensor is handed in; nothing here reads tensors by itself.
    """

    SWAP_HALVES = "swap_halves"
    TRANSPOSE = "transpose"
    SQUEEZE = "squeeze"
    UNSQUEEZE = "unsqueeze"
    SIX_ROWS = "six_rows"
    FLATTEN = "flatten"

    @property
    def inverse(self) -> Transform:
        """The transform that undoes this one (the diffusers -> original direction of a family's)."""
        return {Transform.SQUEEZE: Transform.UNSQUEEZE, Transform.UNSQUEEZE: Transform.SQUEEZE,
                Transform.SIX_ROWS: Transform.FLATTEN, Transform.FLATTEN: Transform.SIX_ROWS}.get(self, self)

    @property
    def keeps_rows(self) -> bool:
        """Every row of the result is one row of the input (False for TRANSPOSE, SIX_ROWS, FLATTEN): a conv
        weight's input dims and a bias's entries stay attached to their row."""
        return self not in (Transform.TRANSPOSE, Transform.SIX_ROWS, Transform.FLATTEN)

    @property
    def row_local(self) -> bool:
        """Row r of the result is row r of the input: the transform of a band of rows is that band of the
        transform, so a reader may stream it in bands."""
        return self in (Transform.SQUEEZE, Transform.UNSQUEEZE)

    def shape(self, shape) -> tuple[int, ...]:
        """The shape of the result for an input of `shape`; ValueError where the input cannot take it."""
        shape = tuple(shape)
        if self is Transform.SWAP_HALVES:
            if not shape:
                raise ValueError("a 0-d tensor has no rows to swap")
            self.row_spans(shape[0])
            return shape
        if self is Transform.TRANSPOSE:
            if len(shape) != 2:
                raise ValueError(f"only 2-D tensors are transposed, not {list(shape)}")
            return shape[1], shape[0]
        if self is Transform.SQUEEZE:
            if len(shape) < 2 or math.prod(shape[2:]) != 1:
                raise ValueError(f"cannot view {list(shape)} as a 2-D weight")
            return shape[:2]
        if self is Transform.SIX_ROWS:
            if len(shape) != 1 or shape[0] % 6:
                raise ValueError(f"cannot view {list(shape)} as six rows")
            return 6, shape[0] // 6
        if self is Transform.FLATTEN:
            return (math.prod(shape),)
        if len(shape) != 2:
            raise ValueError(f"cannot view {list(shape)} as a 1x1 kernel")
        return shape + (1, 1)

    def row_spans(self, rows: int) -> list[tuple[int, int]] | None:
        """The [start, stop) input rows that, stacked in this order, are the result's rows; None where the
        result's rows are not input rows (TRANSPOSE; SIX_ROWS and FLATTEN, which regroup the elements).
        ValueError: an odd row count for SWAP_HALVES."""
        if not self.keeps_rows:
            return None
        if self is Transform.SWAP_HALVES:
            if rows % 2:
                raise ValueError(f"{plural(rows, 'row')} cannot be split in two halves")
            return [(rows // 2, rows), (0, rows // 2)]
        return [(0, rows)]

    def apply(self, x):
        """The transform of tensor `x` (TRANSPOSE: a view; copy with `.contiguous()` where needed)."""
        shape = self.shape(x.shape)
        if self is Transform.TRANSPOSE:
            return x.mT
        if self is Transform.SWAP_HALVES:
            return torch.cat([x[a:b] for a, b in self.row_spans(shape[0])])
        return x.reshape(shape)

    def on_bias(self, b):
        """The transform of the bias beside a weight: its entries follow the weight's rows (SWAP_HALVES
        swaps them too); where rows stay in place or are not rows (TRANSPOSE), the bias is unchanged."""
        return self.apply(b) if self is Transform.SWAP_HALVES else b

    def on_rows(self, d):
        """The transform of a 2-D row view [rows, cols] of a weight (a LoRA delta): SQUEEZE and UNSQUEEZE
        only reshape the columns, which the row view has flattened already, so they leave it as it is."""
        return d if self.row_local else self.apply(d)

    def factors(self, up, down):
        """(up', down') with up' @ down' == on_rows(up @ down): a LoRA's factors carried across the
        transform without forming the product (rows permuted in up; transposed: the factors swap).
        ValueError for SIX_ROWS and FLATTEN: they regroup a 1-D parameter, which no LoRA factors."""
        if self in (Transform.SIX_ROWS, Transform.FLATTEN):
            raise ValueError(f"a {self} tensor (a 1-D modulation table) has no LoRA factors")
        if self is Transform.TRANSPOSE:
            return down.mT, up.mT
        if self is Transform.SWAP_HALVES:
            return self.apply(up), down
        return up, down


@dataclass(frozen=True)
class Pair:
    """One tensor of the original layout and the diffusers tensor made from it.

    `rows` is the [start, stop) slice of the original tensor that the diffusers tensor is (fused qkv,
    qkv+mlp); `transform` is what turns the original rows into the diffusers tensor (`Transform`; a
    family may write its name, "swap_halves", "transpose" or "squeeze", which becomes the member here).
    A side that is None marks a tensor that exists in one layout only (diffusers' converter drops it,
    or the model class makes it): layout conversion drops it with a note and cannot bring it back.
    """

    original: str | None
    diffusers: str | None
    rows: tuple[int, int] | None = None
    transform: Transform | None = None

    def __post_init__(self):
        _as_transform(self)


@dataclass(frozen=True)
class Alias:
    """An extra LoRA module name (relative to the model) for rows of one base tensor: names a trainer
    uses that are in neither layout (XLabs `processor.qkv_lora1`, old diffusers `attn1.processor.to_q`,
    HF CLIP names of an OpenCLIP tower)."""

    name: str
    key: str
    rows: tuple[int, int] | None = None
    transform: Transform | None = None

    def __post_init__(self):
        _as_transform(self)


def _as_transform(obj) -> None:
    """A declared transform name as its `Transform` (once, where the family's table is read); an unknown
    name is an error of the family module, said at once."""
    if obj.transform is not None and not isinstance(obj.transform, Transform):
        object.__setattr__(obj, "transform", Transform(obj.transform))


@dataclass(frozen=True)
class Signature:
    """How to recognise one layout of a family from tensor (or LoRA module) names.

    Patterns are regexes searched in each key; write `_.` where a separator may be `.` or `_` so the same
    rule recognises `blocks.0.self_attn.q.weight` and kohya's `blocks_0_self_attn_q` (use `at()`).
    The score is how many keys `primary` finds; every pattern of `required` must find a key, none of
    `forbidden` may, and `check(keys, shapes)`, when given, must say yes (shapes may be partial: a
    LoRA's factors tell only some base shapes)."""

    primary: str
    required: tuple[str, ...] = ()
    forbidden: tuple[str, ...] = ()
    check: Callable[[list[str], Shapes], bool] | None = None

    def score(self, keys: list[str], shapes: Shapes) -> int:
        hits = _count(keys, self.primary)
        if not hits:
            return 0
        if not all(_count(keys, p, first=True) for p in self.required):
            return 0
        if any(_count(keys, p, first=True) for p in self.forbidden):
            return 0
        if self.check is not None and not self.check(keys, shapes):
            return 0
        return hits

    @property
    def specificity(self) -> int:
        return len(self.required) + len(self.forbidden) + (self.check is not None)


@dataclass(frozen=True)
class GGUFStorage:
    """How ComfyUI-GGUF stores a family (`ckpt convert --to gguf-*`; the original layout only).

    `arch`: its `general.architecture` (a dict per family id where one module answers for several:
    sd1/sd2 -> "sd1", sdxl -> "sdxl"); `f32`: regexes of tensors its tools/convert.py keeps in F32
    (`keys_hiprec`: parameters ComfyUI uses directly, which it cannot load from BF16); `reshape`: conv
    weights stored as rows of 256 with `comfy.gguf.orig_shape.<name>` (SD1/SDXL); `ignore`: regexes of
    tensors its convert.py leaves out (`keys_ignore`: Cosmos' `_extra_state` and `accum_` bookkeeping).
    Which matrices stay unquantized is the family's `high_precision` (its input and output layers), the
    rule ComfyUI-GGUF's patched llama-quantize follows too."""

    arch: str | dict[str, str]
    f32: tuple[str, ...] = ()
    reshape: bool = False
    ignore: tuple[str, ...] = ()

    def arch_for(self, family_id: str | None) -> str | None:
        return self.arch if isinstance(self.arch, str) else self.arch.get(family_id or "")


@dataclass(frozen=True)
class Computed:
    """An original-layout tensor that the diffusers model class computes from its config instead of storing it
    (a rotary `inv_freq` buffer the reference model saves and ComfyUI reads from the file). `value(config)`
    makes it from a diffusers config.json (a dict; {} where the input has none: the model class's defaults
    apply), as the reference computes it and in the dtype the published files store."""

    key: str
    value: Callable[[dict], object]  # config.json -> torch tensor
    source: str = ""  # the config fields it is made from, for the run's note


@dataclass(frozen=True)
class Family:
    """One model family: recognition, correspondence between its layouts, and the facts the commands
    that read it need. Declared as `FAMILY = Family(...)` in one module of `ckpt.families`.

    - `family_id`: the stable id (`ckpt inspect --json`), `ids`: further ids this module answers for when
      several share one correspondence (sd1/sd2/sdxl); `identify(keys, shapes, layout)` returns
      (family id or None when the keys cannot tell, free-text label).
    - `layouts`: layout name ("original", "diffusers", or None for single-naming families) -> Signature.
    - `pairs(shapes, layout)`: every Pair of the model whose keys (prefix stripped) and shapes are given,
      in that layout. Widths come from the shapes; nothing is hard-coded to one model size.
    - `lora_aliases(shapes, layout)`: extra LoRA module names (Alias) beyond both layouts' names.
    - `kohya_layout`: the layout kohya/musubi (`lora_unet_<path with _>`) module names follow;
      `kohya_layouts`: the same per id, where the ids of one module differ (sd1/sd2 vs sdxl).
    - `high_precision`: layout -> regexes of tensor names kept in high precision when quantizing
      (input/output layers, embeddings); 1-D tensors stay high precision everywhere, unsaid.
    - `gguf`: how ComfyUI-GGUF stores the family (`GGUFStorage`), for `convert --to gguf-*`.
    - `blocks`: the model's blocks in depth order, as regexes on original-layout names (prefix stripped), each
      with one group for the block's index or none for a single block (SDXL's `middle_block`): what "layer"
      means to `ckpt merge` gradients (`ckpt.merge.blocks`); empty: the language-model rule (`layers.N.`).
    - `kind`: what the model is; only a "diffusion" model answers to the guarded file prefix
      `model.model.` (`ckpt.families.prefixes`), which language-model wrappers use too.
    - `diffusers_config(shapes)`: the diffusers config.json (with `_class_name`) of a model whose
      diffusers-layout shapes are given; what shapes do not determine comes from the family's
      `CONVENTIONS`; raises `ConventionError` where they do not apply (then `--config REF` is needed).
    - `computed`: original-layout tensors the diffusers model computes from its config rather than stores
      (`Computed`: a rotary `inv_freq` buffer): their Pair has no diffusers side, so `--layout diffusers`
      drops them, and `--layout original` writes them back from the config, whole for the code that reads them.
    - `lora_rows(stored_keys, rows)`: for a LoRA whose trainer stores some modules' output rows in another order
      than the layout's (said by its stored key names, all of them given; `rows`: module name -> the up factor's
      rows), {module name: the [start, stop) stored rows that, stacked, are the layout's rows}; the loader
      reorders the up factor (and its bias) lazily, so every command reads the layout's order. ValueError: rows
      that cannot be reordered (the loader refuses the LoRA with its text).
    """

    family_id: str
    label: str
    layouts: dict[str | None, Signature]
    identify: Callable[[list[str], Shapes, str | None], tuple[str | None, str]] | None = None
    ids: tuple[str, ...] = ()
    diffusers_class: str | None = None
    config_classes: tuple[str, ...] = ()
    pairs: Callable[[Shapes, str], list[Pair]] | None = None
    lora_aliases: Callable[[Shapes, str], list[Alias]] | None = None
    kohya_layout: str | None = None
    kohya_layouts: dict[str, str] = field(default_factory=dict)  # per id, where ids of one module differ
    lora_namings: tuple[str, ...] = ()
    high_precision: dict[str, tuple[str, ...]] = field(default_factory=dict)
    gguf: GGUFStorage | None = None  # ComfyUI-GGUF's architecture and F32 rule for this family
    diffusers_config: Callable[[Shapes], dict] | None = None
    priority: int = 0  # breaks ties between families whose signatures score the same (higher wins)
    kind: str = "diffusion"  # "diffusion" | "text_encoder" | "language_model" | "vae": which file prefixes apply
    blocks: tuple[str, ...] = ()  # depth order of the blocks (ckpt merge's gradients); () = `layers.N.`
    computed: tuple[Computed, ...] = ()  # original tensors made from the diffusers config (`--layout original`)
    lora_rows: Callable[[list[str], dict[str, int]], dict[str, list[tuple[int, int]]]] | None = None
    # (regex on a key, why a file holding it has no counterpart in the other layout): what `--layout` says
    # instead of "no counterpart" (MiniMax-H3's pruned `adaln_t_table`)
    unconvertible: tuple[tuple[str, str], ...] = ()

    @property
    def all_ids(self) -> tuple[str, ...]:
        return (self.family_id,) + tuple(i for i in self.ids if i != self.family_id)

    def describe(self, keys: list[str], shapes: Shapes, layout: str | None) -> tuple[str | None, str]:
        if self.identify is not None:
            return self.identify(keys, shapes, layout)
        return self.family_id, self.label

    def keeps_high_precision(self, key: str, shape: tuple[int, ...], layout: str | None) -> bool:
        """Whether a quantizing writer keeps this tensor in high precision (1-D tensors always)."""
        if len(shape) <= 1:
            return True
        return any(re.search(p, key) for p in self.high_precision.get(layout or "", ()))


class ConventionError(ValueError):
    """The shapes do not say a config value and the family's convention does not fit them."""


@dataclass(frozen=True)
class Match:
    """What a set of keys is: the family module, the id it resolved to (None: the keys do not tell
    which of the module's ids), the layout, a free-text label, and how many keys the signature found."""

    family: Family
    family_id: str | None
    layout: str | None
    label: str
    hits: int


# ------------------------------------------------------------------------------------------- helpers

def at(body: str) -> str:
    """`body` starting at a name boundary; `_.` in body stands for either separator."""
    return rf"(^|{SEP})" + body.replace("_.", SEP)


def start(body: str) -> str:
    """`body` at the start of the key (families whose top-level names are common words: `blocks.`)."""
    return "^" + body.replace("_.", SEP)


def _count(keys: Iterable[str], pattern: str, first: bool = False) -> int:
    rx = re.compile(pattern)
    n = 0
    for k in keys:
        if rx.search(k):
            n += 1
            if first:
                return n
    return n


def has(keys: Iterable[str], pattern: str) -> list[str]:
    rx = re.compile(pattern)
    return [k for k in keys if rx.search(k)]


def dim(shapes: Shapes, keys: Iterable[str], pattern: str, axis: int) -> int | None:
    """Size along `axis` of the first key matching `pattern` whose shape is known."""
    for k in has(keys, pattern):
        s = shapes.get(k)
        if s is not None and len(s) > axis:
            return s[axis]
    return None


def blocks_count(shapes: Shapes, head: str) -> int:
    found = block_indices(shapes, head)
    return found[-1] + 1 if found else 0


def module_of(key: str) -> str:
    """`a.b.weight` -> `a.b`; keys without a parameter suffix are their own module name."""
    for suffix in PARAM_SUFFIXES:
        if key.endswith(suffix):
            return key[: -len(suffix)]
    return key


def prefixes_of(keys) -> set[str]:
    """Every dotted prefix of every key (`a`, `a.b`, `a.b.c` for `a.b.c`): cheap `has_module` tests."""
    out: set[str] = set()
    for k in keys:
        parts = k.split(".")
        for i in range(1, len(parts) + 1):
            out.add(".".join(parts[:i]))
    return out


def block_indices(keys, head: str) -> list[int]:
    """Sorted N of keys `head.N.…` (e.g. `double_blocks`)."""
    found = set()
    lead = head + "."
    for k in keys:
        if k.startswith(lead):
            rest = k[len(lead):].split(".", 1)[0]
            if rest.isdigit():
                found.add(int(rest))
    return sorted(found)


def thirds(begin: int, width: int) -> list[tuple[int, int]]:
    """Row ranges of q, k, v in a fused qkv weight whose pieces are `width` rows each."""
    return [(begin + i * width, begin + (i + 1) * width) for i in range(3)]


def renames(table, prefix_o: str = "", prefix_d: str = "", ends=("weight", "bias")) -> list[Pair]:
    """Pairs for a table of (original module, diffusers module) renames, one per parameter suffix."""
    return [Pair(f"{prefix_o}{o}.{e}", f"{prefix_d}{d}.{e}") for o, d in table for e in ends]


def present(pairs: list[Pair], shapes: Shapes, layout: str) -> list[Pair]:
    """The pairs whose tensor in `layout` exists in `shapes` (tables list optional tensors too: biases,
    I2V-only modules). A pair with no tensor on this side does not concern a file of this layout."""
    side = (lambda p: p.original) if layout == ORIGINAL else (lambda p: p.diffusers)
    return [p for p in pairs if side(p) is not None and side(p) in shapes]
