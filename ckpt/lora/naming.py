"""The module names an extracted LoRA gets: the base's weights grouped into output modules, in the
naming of the chosen format, from the family registry (`ckpt.families`).

The base is split into its models as the merge key map splits it (diffusion model, text encoders,
VAE... `ckpt.adapters.keymap.base_parts`), each recognised by the registry (family and layout). A format
names modules in one layout of that family:

- peft: the model's own names (a PEFT adapter wraps the model object the base holds);
- kohya: `lora_unet_` + the family's `kohya_layout` path with `.` -> `_` (Flux, SD3, Wan: original
  names; SD1/SD2 UNets: diffusers names; SDXL: LDM names), text encoders `lora_te{N}_` + Hugging Face
  CLIP names (`lora_te_` when the base has one text encoder);
- diffusers: `PREFIX.` + the diffusers-layout path (PREFIX `transformer`, `unet`, `text_encoder[_N]`);
- comfy: `diffusion_model.` + the original-layout path (what ComfyUI's own LoRA files name), text
  encoders as kohya names them.

When the naming's layout is not the base's, the registry's `pairs` say how weights correspond: one
original weight may become several modules (BFL `img_attn.qkv` -> `to_q`, `to_k`, `to_v`: row slices of
its delta), several diffusers weights one module (`to_q/k/v` -> `img_attn.qkv`: their deltas stacked and
decomposed together), a transform may apply (`swap_halves`). Each output module is a `Group`: the base
weights whose deltas are stacked by rows, and the `Piece`s cut from that stack. Every name is checked
to resolve back through the merge key map (`ckpt.adapters.keymap`) to exactly those weights and rows:
what `ckpt lora extract` writes, `ckpt merge-lora` merges into the same base, by construction.

A weight without a name in the chosen naming keeps the reason; it is an error only when that weight
actually changed. Weights outside every model a LoRA adapts (VAE, EMA copies) are not candidates.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckpt.lazy import torch

from ckpt.families import DIFFUSERS, ORIGINAL, Transform, module_of
from ckpt.adapters.keymap import base_parts, build_keymap
from ckpt.adapters.placement import Placement


@dataclass(frozen=True)
class Piece:
    """One output module cut from a group's stacked delta."""

    name: str  # module name in the output naming (no role suffix)
    rows: tuple[int, int] | None = None  # rows [start, stop) of the stacked delta
    transform: Transform | None = None  # the family's, from the base's rows to the module's

    def of(self, delta: torch.Tensor) -> torch.Tensor:
        """This piece's delta, in its module's own layout, from the group's 2-D stacked delta."""
        d = delta if self.rows is None else delta[self.rows[0]:self.rows[1]]
        return d if self.transform is None else self.transform.on_rows(d)


@dataclass
class Group:
    """Base weights (keys with their file prefix, in row order) whose stacked delta the pieces cut."""

    keys: list[str]
    pieces: list[Piece] | None = None
    reason: str | None = None  # why these weights have no name in the naming


class Naming:
    """The groups of one component's weights in one output naming."""

    def __init__(self, fmt: str, shapes: dict[str, tuple[int, ...]], component: str, config: dict | None,
                 single_component: bool):
        self.fmt = fmt
        self.km = build_keymap(shapes, component or None)
        self.groups: list[Group] = []
        self.outside: set[str] = set()  # weights of VAEs, EMA copies...: no LoRA names them
        self.prefixes: set[str] = set()  # diffusers prefixes used
        parts = base_parts(shapes, component or None)
        n_te = len({p.identity for p in parts if p.role == "te"})
        for part in parts:
            self._name_part(part, component, config, single_component, n_te)

    # -- one model of the base -----------------------------------------------------------------------
    def _name_part(self, part, component, config, single_component, n_te):
        keys = [k for k in part.keys if k.endswith(".weight") or k == "text_projection"]
        if part.role == "other":
            self.outside.update(part.prefix + k for k in keys)
            return
        match = part.detect()
        base_layout = match.layout if match is not None else None
        fam = match.family if match is not None else None
        if self.fmt == "peft":
            if not part.standalone or not single_component:
                return self._refuse(part, keys, "a PEFT adapter folder holds one model; this base holds several "
                                                "(use --format kohya, or extract from the model's own folder)")
            return self._same(part, keys, "base_model.model.")
        if self.fmt == "comfy" and part.role == "dm":  # ComfyUI: its model's own (original) names, dotted
            head, flat = "diffusion_model.", False
            want = ORIGINAL if fam is not None and ORIGINAL in fam.layouts else None
        elif self.fmt in ("kohya", "comfy"):
            head = "lora_unet_" if part.role == "dm" else (
                "lora_te_" if part.plain_te and n_te == 1 else f"lora_te{max(part.te_numbers or (1,))}_")
            want = _kohya_layout(match)
            flat = True
        else:
            head = _diffusers_prefix(component, config, part, fam)
            if head is None:
                return self._refuse(part, keys, "diffusers naming needs to know the model (transformer or unet), "
                                                "and no family recognises it: pass --base BASE (the model, or its "
                                                "diffusers folder), or use --format kohya or peft")
            self.prefixes.add(head)
            head += "."
            want = DIFFUSERS if base_layout is not None else None
            flat = False
        if want is None or base_layout is None or want == base_layout or fam.pairs is None:
            return self._same(part, keys, head, flat, _wrapped(fam, part.keys, base_layout) if flat else None)
        self._across(part, keys, fam, base_layout, head, flat)

    def _refuse(self, part, keys, why):
        for k in keys:
            self.groups.append(Group([part.prefix + k], reason=why))

    def _same(self, part, keys, head, flat=False, wrapped=None):
        wrapped = wrapped or {}
        for k in keys:
            self._add(part, [k], [Piece(_spell(head, wrapped.get(k, module_of(k)), flat))])

    def _across(self, part, keys, fam, base_layout, head, flat):
        """The base in one layout, the names in the other: the registry's pairs say which weights and rows."""
        pairs = [p for p in fam.pairs(part.keys, base_layout) if not (p.original or "").endswith((".bias", "_bias"))]
        done: set[str] = set()
        if base_layout == ORIGINAL:  # one original weight -> the diffusers modules cut from it
            by_key: dict[str, list] = {}
            for p in pairs:
                if p.original in part.keys:
                    by_key.setdefault(p.original, []).append(p)
            for k in keys:
                ps = by_key.get(k)
                if not ps or any(p.diffusers is None for p in ps):
                    continue
                self._add(part, [k], [Piece(_spell(head, module_of(p.diffusers), flat), p.rows, p.transform)
                                      for p in ps])
                done.add(k)
        else:  # diffusers weights -> the original module they are rows of, stacked in row order
            by_original: dict[str, list] = {}
            for p in pairs:
                if p.diffusers in part.keys and p.original is not None:
                    by_original.setdefault(p.original, []).append(p)
            whole = _complete(fam, part.keys, by_original)
            for original, ps in by_original.items():
                ps = sorted(ps, key=lambda p: (p.rows or (0, 0))[0])
                ks = [p.diffusers for p in ps]
                if not all(k in keys for k in ks):
                    continue
                if original not in whole:
                    for k in ks:
                        self.groups.append(Group([part.prefix + k], reason=(
                            f"{part.prefix + k!r} is one piece of {original!r}, whose other pieces this model "
                            "lacks, so the fused module's size is unknown (pass --base BASE)")))
                    done.update(ks)
                    continue
                transform = ps[0].transform if len(ps) == 1 else None
                self._add(part, ks, [Piece(_spell(head, module_of(original), flat), None, transform)],
                          parts=[p.rows for p in ps])
                done.update(ks)
        for k in keys:
            if k not in done:
                self.groups.append(Group([part.prefix + k], reason=f"{part.prefix + k!r} has no counterpart in "
                                                                   f"the layout {self.fmt} names this model in"))

    def _add(self, part, keys, pieces, parts=None):
        """Record a group if every name resolves back, through the key map, to the same weights and rows."""
        full = [part.prefix + k for k in keys]
        for p in pieces:
            if parts is None:
                want = {Placement(full[0], p.rows, p.transform)}
            else:  # several weights, one fused module: each weight takes its rows of the module's delta
                want = {Placement(k, transform=p.transform, part=r) for k, r in zip(full, parts)}
                if len(full) == 1 and parts[0] is None:
                    want = {Placement(full[0], transform=p.transform)}
            got = set(self.km.targets(p.name))
            if got != want:
                self.groups.append(Group(full, reason=f"the {self.fmt} name {p.name!r} would not merge back into "
                                                      f"{', '.join(full)} (ambiguous in this base)"))
                return
        self.groups.append(Group(full, pieces))


def _complete(fam, shapes, by_original) -> set[str]:
    """The original weights all of whose diffusers pieces are present: the family's own split of an
    original weight of the size the present pieces add up to must give back exactly those pieces (a
    LoRA naming only some of q/k/v, read as a model, lacks the others)."""
    orig = {}
    for original, ps in by_original.items():
        own = [_original_shape(p, shapes[p.diffusers]) for p in ps]
        rows = max(p.rows[1] if p.rows else s[0] for p, s in zip(ps, own))
        orig[original] = (rows,) + tuple(own[0][1:])
    back: dict[str, set] = {}
    for p in fam.pairs(orig, ORIGINAL):
        if p.original in orig and p.diffusers is not None:
            back.setdefault(p.original, set()).add((p.diffusers, p.rows))
    return {o for o, ps in by_original.items() if back.get(o) == {(p.diffusers, p.rows) for p in ps}}


def _original_shape(pair, shape) -> tuple[int, ...]:
    """The shape of a diffusers tensor's rows in the original layout (the pair's transform undone); the
    diffusers shape where the transform cannot apply to it (the family's split then tells)."""
    if pair.transform is None:
        return tuple(shape)
    try:
        return pair.transform.inverse.shape(shape)
    except ValueError:
        return tuple(shape)


def _wrapped(fam, shapes, layout) -> dict[str, str]:
    """key -> the name trainers give it where the family declares a wrapper around the file's own path
    (HF CLIP saved without `text_model.`: kohya still writes `lora_te1_text_model_encoder_...`): an
    alias for a whole weight whose name ends with that weight's own module path."""
    if fam is None or fam.lora_aliases is None:
        return {}
    out = {}
    for a in fam.lora_aliases(shapes, layout):
        own = module_of(a.key)
        if a.rows is None and a.transform is None and a.name != own and a.name.endswith("." + own):
            out.setdefault(a.key, a.name)
    return out


def _spell(head: str, name: str, flat: bool) -> str:
    return head + (name.replace(".", "_") if flat else name)


def _kohya_layout(match) -> str | None:
    """The layout kohya names a recognised model in (the registry's `kohya_layout`, per id where the
    family module answers for several); None: the base's own names."""
    if match is None:
        return None
    return match.family.kohya_layouts.get(match.family_id, match.family.kohya_layout)


def _diffusers_prefix(component: str, config: dict | None, part, fam) -> str | None:
    """`unet` / `transformer` / `text_encoder[_N]` for one model of the base, else None."""
    comp = (component or "").strip("/")
    if comp in ("unet", "transformer", "prior", "decoder") or comp.startswith("text_encoder"):
        return comp
    if part.role == "te":  # diffusers numbers a pipeline's encoders 1, 2, 3 (Flux's T5: text_encoder_2)
        n = min(part.te_numbers or (1,))
        return "text_encoder" if n == 1 else f"text_encoder_{n}"
    cls = fam.diffusers_class if fam is not None else str((config or {}).get("_class_name") or "")
    if not cls:
        return None
    return "unet" if "UNet" in cls else "transformer"
