"""Which base weight a LoRA module lands on, found by spelling the base's own keys every way LoRAs do.

This follows ComfyUI's approach (`model_lora_keys_unet/clip`): instead of parsing LoRA names (kohya
names replace every `.` with `_`, so they cannot be split back reliably), every base key is expanded into
all the names a trainer may have given its module:

- the key itself and the key without its file prefix (`model.diffusion_model.`, `model.model.`
  (`ckpt.families.prefixes`), `cond_stage_model.`,
  `conditioner.embedders.N.`, `text_encoders.clip_l.transformer.`, pipeline `unet/`...);
- diffusion-model spellings: `lora_unet_`/`lycoris_`/`lora_transformer_` + name with `.` -> `_`, and
  `diffusion_model.`/`transformer.`/`unet.`/`base_model.model.` + name;
- text-encoder spellings: `lora_te{N}_`/`lora_te_` + flat name, `text_encoder(_N).` + name, with N
  following kohya's order (SDXL: te1 = CLIP-L `conditioner.embedders.0`, te2 = bigG `.1`; SD3/Flux:
  CLIP-L, CLIP-G, T5);
- the names of the other layout of the same family, from the family registry (`ckpt.families`: each
  family's `pairs`, LDM <-> diffusers UNet names, OpenCLIP <-> HF CLIP, BFL/SAI/Wan <-> diffusers
  transformer names, with row slices of fused weights) and the family's extra LoRA names.

A name that two different base weights claim is ambiguous and looked up as nothing; `ambiguous()` says
who claimed it so the merge can name them. A LoRA made on a fused weight that the base stores in pieces
(kohya `img_attn.qkv` on a diffusers Flux) has several Targets, one per piece: see `KeyMap.targets`.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field, replace

from ckpt import families
from ckpt.families import ORIGINAL, Match, Pair, Shapes, module_of
from ckpt.families import clip as clip_family
from ckpt.families.lora_namings import lora_target
from ckpt.families.prefixes import MODEL_PREFIXES, accepts
from ckpt.adapters.placement import Placement

DM_DOTTED = ("", "diffusion_model.", "model.diffusion_model.", "transformer.", "unet.", "base_model.model.",
             "unet.base_model.model.")
DM_FLAT = ("lora_unet_", "lycoris_", "lora_transformer_")

# File prefixes of the parts of a single-file checkpoint (and pipeline folders given as `sub/key`).
# Group 1 or 2 is the part's identity (text encoders of one identity share their kohya number); a
# text encoder's own `transformer.`/`model.` wrapper (group 3) is stripped too.
_DM_FILE = "|".join(re.escape(p) for p in sorted(MODEL_PREFIXES, key=len, reverse=True))  # families.prefixes
FILE_PREFIX = re.compile(
    r"^(?:(" + _DM_FILE + r"|first_stage_model\.|model_ema\.|[a-z_0-9]+/)"
    r"|(cond_stage_model\.|conditioner\.embedders\.\d+\.|text_encoders\.[^./]+\.)((?:transformer|model)\.)?)"
)
TE_IDENTITY = re.compile(
    r"^(cond_stage_model\.|conditioner\.embedders\.(\d+)\.|text_encoders\.([^.]+)\.|text_encoder(?:_(\d+))?/)$"
)
DM_COMPONENTS = {"unet", "transformer", "prior", "decoder", *MODEL_PREFIXES}


@dataclass
class BaseComponent:
    """One model inside the base: keys relative to `prefix`, and how LoRAs address it."""

    prefix: str  # re-added in front of every Placement key
    identity: str  # outer prefix, e.g. "conditioner.embedders.1." (shared by `.model.` and other keys)
    keys: Shapes
    role: str = "other"  # "dm" (diffusion model / any main model) | "te" | "other" (raw names only)
    te_numbers: tuple[int, ...] = ()  # kohya lora_te{N}_ numbers
    plain_te: bool = False  # also `lora_te_` (SD1/SD2, or the only text encoder)
    standalone: bool = False  # the whole base is this model (PEFT `base_model.model.` names it)
    family: str = ""
    match: Match | None = None  # what the family registry says these keys are

    _detected: bool = field(default=False, repr=False)

    def detect(self) -> Match | None:
        if not self._detected:
            self.match, self._detected = families.detect(self.keys, self.keys), True
        return self.match


@dataclass(frozen=True)
class ExpertBank:
    """The Placement transform of a 3-D expert parameter [E, in, out] a PEFT `target_parameters` (ParamWrapper) LoRA
    changes, whole bank (`ckpt.adapters.kinds.experts`)."""

    experts: int
    prepared: bool = False  # the patch carries its ExpertLoRA (`experts_patches`); only then does it apply

    row_local = False
    keeps_rows = True

    def shape(self, shape):
        if len(shape) != 3 or shape[0] != self.experts:
            raise ValueError(f"not an expert bank of {self.experts} experts: {list(shape)}")
        return (shape[2], shape[1])  # the [out, in] of the LoRA's factors

    def apply(self, x):
        if not self.prepared:  # a path that merges patches without `experts_patches`: refuse, never misapply
            from ckpt.errors import CkptError

            raise CkptError("a PEFT target_parameters LoRA on an expert bank reached a merge that does not prepare it "
                            "(ckpt.adapters.matching.match_loras does); nothing was written")
        return x  # the bank as stored: `ExpertLoRA.apply` works on it directly

    @property
    def inverse(self):
        return self

    def on_bias(self, x):
        raise ValueError("a ParamWrapper LoRA has no bias delta")

    def __str__(self):
        return f"expert bank ({self.experts} experts)"


# gpt-oss expert banks (transformers' GptOssExperts: [E, in, out], registered gate_up_proj then down_proj, each with
# a `_bias`): PEFT nests one ParamWrapper per targeted parameter, the first registered innermost, so with both
# targeted `experts` is down_proj's and `experts.base_layer` gate_up_proj's; down_proj alone is `experts` too.
EXPERT_BANKS = (("down_proj", ""), ("gate_up_proj", ".base_layer"))


def expert_aliases(keys: Shapes) -> list[KeyAlias]:
    """PEFT target_parameters names of gpt-oss expert banks (EXPERT_BANKS): module `M` (and `M.base_layer`) ->
    `M.down_proj` (and `M.gate_up_proj`), each with its ExpertBank transform."""
    out = []
    for key, shape in keys.items():
        if not key.endswith(".gate_up_proj") or len(shape) != 3:
            continue
        m = key[: -len(".gate_up_proj")]
        down, bias = keys.get(m + ".down_proj"), keys.get(m + ".gate_up_proj_bias")
        if down is None or len(down) != 3 or down[0] != shape[0] or bias is None:
            continue
        for param, nest in EXPERT_BANKS:
            out.append(KeyAlias(m + nest, (Placement(f"{m}.{param}", transform=ExpertBank(shape[0])),)))
    return out


@dataclass(frozen=True)
class KeyAlias:
    """Module `name` (a family's scheme, relative to the model) lands on `targets` (keys relative too)."""

    name: str
    targets: tuple[Placement, ...]


class KeyMap:
    """LoRA module name -> where its delta goes. Built by `build_keymap`."""

    def __init__(self):
        self._claims: dict[str, list[tuple[Placement, ...]]] = {}
        self.families: list[str] = []  # what was recognised, for messages ("Flux (BFL layout)", ...)
        self.matches: list[tuple[str, Match]] = []  # (part prefix, family match) of each recognised part
        self.main: Match | None = None  # the diffusion model's (or the only model's) family

    def _add(self, name: str, targets: tuple[Placement, ...]):
        claims = self._claims.setdefault(name, [])
        if targets not in claims:
            claims.append(targets)

    def targets(self, module_name: str) -> list[Placement]:
        """All Targets of the module: one, several for a fused LoRA split over separate base weights
        (each with `part` rows of the delta), or none (unknown or ambiguous)."""
        claims = self._claims.get(module_name)
        return list(claims[0]) if claims and len(claims) == 1 else []

    def lookup(self, module_name: str) -> Placement | None:
        """The one base weight (or row slice) the module lands on; None if unknown, ambiguous or split."""
        found = self.targets(module_name)
        return found[0] if len(found) == 1 and found[0].part is None else None

    def ambiguous(self, module_name: str) -> list[Placement]:
        """Every Placement claimed for the name when several base weights claim it, else []."""
        claims = self._claims.get(module_name)
        if not claims or len(claims) < 2:
            return []
        seen: list[Placement] = []
        for group in claims:
            seen += [t for t in group if t not in seen]
        return seen

    def __contains__(self, module_name: str) -> bool:
        return module_name in self._claims

    def __len__(self) -> int:
        return len(self._claims)

    def names(self):
        return self._claims.keys()


def build_keymap(base: dict[str, tuple[int, ...]], component: str | None = None) -> KeyMap:
    """Key map of a base given as {logical key: shape}.

    `component` names a diffusers pipeline subfolder the keys come from ("unet", "transformer",
    "text_encoder_2", ...) when the caller builds one map per component; keys may instead carry a
    `subfolder/` prefix, which is then kept in the Targets.
    """
    km = KeyMap()
    for part in base_parts(base, component):
        aliases = [KeyAlias(module_of(k), (Placement(k),)) for k in part.keys if not _is_bias(k)]
        match = part.detect() if part.role != "other" else None
        if match is not None:
            part.family = match.label
            km.families.append(f"{match.label} at {part.prefix or 'top level'}")
            km.matches.append((part.prefix, match))
            if km.main is None and part.role == "dm":
                km.main = match
            raw = {a.name for a in aliases}
            extra = family_aliases(match, part.keys)
            if match.layout == ORIGINAL:
                # A name both layouts use means the diffusers module there (OpenCLIP `text_projection` is
                # stored transposed): the family alias replaces the raw one instead of making it ambiguous.
                renamed = {a.name for a in extra}
                aliases = [a for a in aliases if a.name not in renamed] + extra
            else:
                aliases += [a for a in extra if a.name not in raw]
        raw = {a.name for a in aliases}
        aliases += [a for a in expert_aliases(part.keys) if a.name not in raw]
        for alias in aliases:
            targets = tuple(replace(t, key=part.prefix + t.key) for t in alias.targets)
            for name in _spellings(part, alias.name):
                km._add(name, targets)
    return km


def family_note(modules, keymaps: list[KeyMap]) -> str:
    """What the LoRA's module names look like and what the base is, for the unmatched-keys error:
    "kohya LoRA for wan (original names); base is flux2 (diffusers layout)"."""
    names, shapes = [], {}
    for m in modules:
        names.append(m.name)
        down, up = m.parts.get("down"), m.parts.get("up")
        if down is not None and up is not None and len(down.shape) >= 2 and up.shape:
            shapes[m.name] = (up.shape[0], down.shape[1], *down.shape[2:])
    naming, lora = lora_target(names, shapes)
    said = f"{naming} LoRA for " + (f"{_family_text(lora)}" if lora else "a model no family recognises")
    base = next((km.main for km in keymaps if km.main), None) or next(
        (m for km in keymaps for _, m in km.matches), None)
    lora_te = _text_encoders(names)
    base_te = _text_encoders(n for km in keymaps for n in km.names() if n.startswith("lora_te"))
    if lora_te:
        said += f", with {'/'.join(lora_te)} keys"
    based = _family_text(base) if base else "a model no family recognises"
    if lora_te and {t.replace("te1", "te") for t in lora_te} - {t.replace("te1", "te") for t in base_te}:
        based += (f", with text encoder{'s' * (len(base_te) != 1)} {'/'.join(base_te)}" if base_te
                  else ", with no text encoder")
    return said + "; base is " + based


_TE = re.compile(r"^(?:lora_te(\d?)_|text_encoder(?:_(\d))?\.)")


def _text_encoders(names) -> list[str]:
    """kohya's text-encoder numbers among module names: `lora_te_` (SD1/SD2) is te, `lora_te1_`/
    `text_encoder.` te1, `lora_te2_`/`text_encoder_2.` te2, ... (sorted)."""
    seen = set()
    for n in names:
        m = _TE.match(n)
        if m:
            seen.add("te" + (m[1] or (m[2] or ("1" if n.startswith("text_encoder.") else ""))))
    return sorted(seen)


def _family_text(m: Match) -> str:
    return f"{m.family_id or m.family.label} ({families.layout_name(m.layout)})"


def family_aliases(match: Match, keys: Shapes) -> list[KeyAlias]:
    """The other layout's module names for a recognised base, and the family's extra LoRA names."""
    fam = match.family
    out: list[KeyAlias] = []
    if fam.pairs is not None and match.layout is not None:
        out += pair_aliases(fam.pairs(keys, match.layout), keys, match.layout == ORIGINAL)
    if fam.lora_aliases is not None:
        out += [KeyAlias(a.name, (Placement(a.key, a.rows, a.transform),)) for a in fam.lora_aliases(keys, match.layout)]
    return out


def pair_aliases(pairs: list[Pair], base: Shapes, original_base: bool) -> list[KeyAlias]:
    """Aliases for a base stored in the original layout (diffusers names -> original rows) or as
    diffusers (the reverse).

    In the reverse direction an original module fused from several diffusers tensors (qkv, linear1)
    becomes one alias with one Placement per piece, each saying which rows of the LoRA delta it takes
    (`part`). An original module is only offered when every piece exists in the base.
    """
    out: list[KeyAlias] = []
    # biases follow their weight's Placement; one-side-only tensors have no other name
    pairs = [p for p in pairs if p.original and p.diffusers and not p.original.endswith((".bias", "_bias"))]
    if original_base:
        for p in pairs:
            if p.original in base:
                out.append(KeyAlias(module_of(p.diffusers), (Placement(p.original, p.rows, p.transform),)))
        return out
    groups: dict[str, list[Pair]] = defaultdict(list)
    for p in pairs:
        groups[p.original].append(p)
    for original, group in groups.items():
        if not all(p.diffusers in base for p in group):
            continue
        if len(group) == 1 and group[0].rows is None:
            p = group[0]
            targets = (Placement(p.diffusers, transform=p.transform),)
        else:
            targets = tuple(Placement(p.diffusers, transform=p.transform, part=p.rows) for p in group)
        out.append(KeyAlias(module_of(original), targets))
    return out


def _is_bias(key: str) -> bool:
    return key.endswith((".bias", "_bias"))


def _spellings(part: BaseComponent, name: str) -> list[str]:
    flat = name.replace(".", "_")
    out = [part.prefix + name]
    if part.role == "other":
        return out
    out.append(name)
    if part.role == "dm":
        out += [p + name for p in DM_DOTTED] + [p + flat for p in DM_FLAT]
    elif part.role == "te":
        for n in part.te_numbers:
            out.append(f"lora_te{n}_{flat}")
            out.append(("text_encoder." if n == 1 else f"text_encoder_{n}.") + name)
        if part.plain_te:
            out.append(f"lora_te_{flat}")
        if part.standalone:
            out.append("base_model.model." + name)
    return out


def base_parts(base: Shapes, component: str | None) -> list[BaseComponent]:
    if component:
        comp = component.strip("/")
        part = BaseComponent("", comp + "/", dict(base), standalone=True)
        _assign_role(part, comp + "/")
        if part.role == "other" and comp != "vae":
            part.role = "te" if _te_kind(part) else "dm"
        if part.role == "te" and not part.te_numbers:
            _standalone_te(part)
        return [part]

    groups: dict[str, BaseComponent] = {}
    for key, shape in base.items():
        m = FILE_PREFIX.match(key)
        prefix = m.group(0) if m else ""
        identity = (m.group(1) or m.group(2)) if m else ""
        part = groups.get(prefix)
        if part is None:
            part = groups[prefix] = BaseComponent(prefix, identity, {})
        part.keys[key[len(prefix):]] = shape
    for prefix in [p for p in groups if p and not accepts(p, list(groups[p].keys), groups[p].keys)]:
        top = groups.setdefault("", BaseComponent("", "", {}))  # `model.model.` of a language-model wrapper: raw keys
        top.keys.update({prefix + k: v for k, v in groups.pop(prefix).keys.items()})
    parts = list(groups.values())
    for part in parts:
        _assign_role(part, part.identity)
    top = groups.get("")
    if top is not None:
        others = [p for p in parts if p is not top and p.role != "other"]
        if not others:
            top.standalone = True
            top.role = "te" if _te_kind(top) else "dm"
            if top.role == "te":
                _standalone_te(top)
        elif not any(p.role == "dm" for p in others) and not _te_kind(top):
            top.role = "dm"
    _number_text_encoders([p for p in parts if p.role == "te" and not p.te_numbers])
    return parts


def _assign_role(part: BaseComponent, identity: str):
    if identity in DM_COMPONENTS or identity.rstrip("/") in DM_COMPONENTS:
        part.role = "dm"
        return
    m = TE_IDENTITY.match(identity)
    if not m:
        return  # VAE, EMA copies, image encoders, ...: raw names only
    part.role = "te"
    if m.group(2) is not None:  # conditioner.embedders.N: kohya numbers them N+1 (SDXL te1, te2)
        part.te_numbers = (int(m.group(2)) + 1,)
    elif identity.endswith("/"):  # pipeline text_encoder, text_encoder_2, ...
        n = int(m.group(4) or 1)
        part.te_numbers = (n, 3) if n == 2 and _te_kind(part) == "t5" else (n,)
    elif identity == "cond_stage_model.":
        part.te_numbers = (1,)
    if part.te_numbers and part.te_numbers[0] == 1:
        part.plain_te = True


def _te_kind(part: BaseComponent) -> str | None:
    """"clip_l" / "clip_g" (HF CLIP or OpenCLIP, by width), "t5", or None for anything else."""
    match = part.detect()
    if match is None:
        return None
    if match.family.family_id == "clip":
        return clip_family.kind(list(part.keys), part.keys)
    return "t5" if match.family.family_id == "t5" else None


def _standalone_te(part: BaseComponent):
    """A lone text-encoder file: numbers under which kohya/diffusers name this kind of encoder."""
    kind = _te_kind(part)
    part.te_numbers = {"clip_g": (2,), "t5": (1, 2, 3)}.get(kind, (1,))
    part.plain_te = True


def _number_text_encoders(parts: list[BaseComponent]):
    """kohya numbers for `text_encoders.NAME.` parts: CLIP-L first, CLIP-G next, T5 last (SD3: te1-te3;
    Flux, CLIP-L + T5: T5 answers to both te2 (OneTrainer) and te3 (kohya))."""
    by_identity: dict[str, list[BaseComponent]] = {}
    for p in parts:
        by_identity.setdefault(p.identity, []).append(p)
    order = {"clip_l": 0, "clip_g": 1, "t5": 2, None: 3}
    kinds = {}
    for ident, ps in by_identity.items():
        name = ident.split(".")[1] if ident.startswith("text_encoders.") else ""
        kind = next((k for k in (_te_kind(p) for p in ps) if k), None)
        if name in ("clip_l", "clip_h"):
            kind = "clip_l"
        elif name == "clip_g":
            kind = "clip_g"
        kinds[ident] = kind
    ranked = sorted(by_identity, key=lambda i: (order[kinds[i]], i))
    present = set(kinds.values())
    for n, ident in enumerate(ranked, start=1):
        numbers = (n,)
        if kinds[ident] == "t5" and n == 2 and "clip_l" in present and "clip_g" not in present:
            numbers = (2, 3)
        for p in by_identity[ident]:
            p.te_numbers = numbers
            p.plain_te = n == 1
