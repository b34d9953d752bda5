"""Which base weight a LoRA module lands on, found by spelling the base's own keys every way LoRAs do.

This follows ComfyUI's approach (`model_lora_keys_unet/clip`): instead of parsing LoRA names (kohya
names replace every `.` with `_`, so they cannot be split back reliably), every base key is expanded into
all the names a trainer may have given its module:

- the key itself and the key without its file prefix (`model.diffusion_model.`, `cond_stage_model.`,
  `conditioner.embedders.N.`, `text_encoders.clip_l.transformer.`, pipeline `unet/`...);
- diffusion-model spellings: `lora_unet_`/`lycoris_`/`lora_transformer_` + name with `.` -> `_`, and
  `diffusion_model.`/`transformer.`/`unet.`/`base_model.model.` + name;
- text-encoder spellings: `lora_te{N}_`/`lora_te_` + flat name, `text_encoder(_N).` + name, with N
  following kohya's order (SDXL: te1 = CLIP-L `conditioner.embedders.0`, te2 = bigG `.1`; SD3/Flux:
  CLIP-L, CLIP-G, T5);
- the names of the other layout of the same family (`ckpt.merge.keymaps`: LDM <-> diffusers UNet names,
  OpenCLIP <-> HF CLIP, BFL/SAI <-> diffusers transformer names, with row slices of fused weights).

A name that two different base weights claim is ambiguous and looked up as nothing; `ambiguous()` says
who claimed it so the merge can name them. A LoRA made on a fused weight that the base stores in pieces
(kohya `img_attn.qkv` on a diffusers Flux) has several Targets, one per piece: see `KeyMap.targets`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from ckpt.merge.keymaps import Alias, Shapes, flux, hf_clip, module_of, openclip, sd3, sd_unet
from ckpt.merge.targets import Target

# Family modules, tried in order on each part of the base; the first that recognises it adds aliases.
FAMILIES = (
    ("SD UNet", sd_unet.aliases),
    ("Flux", flux.aliases),
    ("SD3 MMDiT", sd3.aliases),
    ("OpenCLIP text", openclip.aliases),
    ("CLIP text (no text_model. wrapper)", hf_clip.aliases),
)

DM_DOTTED = ("", "diffusion_model.", "model.diffusion_model.", "transformer.", "unet.", "base_model.model.",
             "unet.base_model.model.")
DM_FLAT = ("lora_unet_", "lycoris_", "lora_transformer_")

# File prefixes of the parts of a single-file checkpoint (and pipeline folders given as `sub/key`).
# Group 1 or 2 is the part's identity (text encoders of one identity share their kohya number); a
# text encoder's own `transformer.`/`model.` wrapper (group 3) is stripped too.
FILE_PREFIX = re.compile(
    r"^(?:((?:model\.)?diffusion_model\.|first_stage_model\.|model_ema\.|[a-z_0-9]+/)"
    r"|(cond_stage_model\.|conditioner\.embedders\.\d+\.|text_encoders\.[^./]+\.)((?:transformer|model)\.)?)"
)
TE_IDENTITY = re.compile(
    r"^(cond_stage_model\.|conditioner\.embedders\.(\d+)\.|text_encoders\.([^.]+)\.|text_encoder(?:_(\d+))?/)$"
)
DM_COMPONENTS = {"unet", "transformer", "prior", "decoder", "model.diffusion_model.", "diffusion_model."}


@dataclass
class Part:
    """One model inside the base: keys relative to `prefix`, and how LoRAs address it."""

    prefix: str  # re-added in front of every Target key
    identity: str  # outer prefix, e.g. "conditioner.embedders.1." (shared by `.model.` and other keys)
    keys: Shapes
    role: str = "other"  # "dm" (diffusion model / any main model) | "te" | "other" (raw names only)
    te_numbers: tuple[int, ...] = ()  # kohya lora_te{N}_ numbers
    plain_te: bool = False  # also `lora_te_` (SD1/SD2, or the only text encoder)
    standalone: bool = False  # the whole base is this model (PEFT `base_model.model.` names it)
    family: str = ""


class KeyMap:
    """LoRA module name -> where its delta goes. Built by `build_keymap`."""

    def __init__(self):
        self._claims: dict[str, list[tuple[Target, ...]]] = {}
        self.families: list[str] = []  # what was recognised, for messages ("Flux (BFL layout)", ...)

    def _add(self, name: str, targets: tuple[Target, ...]):
        claims = self._claims.setdefault(name, [])
        if targets not in claims:
            claims.append(targets)

    def targets(self, module_name: str) -> list[Target]:
        """All Targets of the module: one, several for a fused LoRA split over separate base weights
        (each with `part` rows of the delta), or none (unknown or ambiguous)."""
        claims = self._claims.get(module_name)
        return list(claims[0]) if claims and len(claims) == 1 else []

    def lookup(self, module_name: str) -> Target | None:
        """The one base weight (or row slice) the module lands on; None if unknown, ambiguous or split."""
        found = self.targets(module_name)
        return found[0] if len(found) == 1 and found[0].part is None else None

    def ambiguous(self, module_name: str) -> list[Target]:
        """Every Target claimed for the name when several base weights claim it, else []."""
        claims = self._claims.get(module_name)
        if not claims or len(claims) < 2:
            return []
        seen: list[Target] = []
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
    for part in _parts(base, component):
        aliases = [Alias(module_of(k), (Target(k),)) for k in part.keys if not _is_bias(k)]
        if part.role != "other":
            for label, make in FAMILIES:
                extra = make(part.keys)
                if extra is not None:
                    part.family = label
                    km.families.append(f"{label} at {part.prefix or 'top level'}")
                    # A family alias that reuses a raw name says more (OpenCLIP `text_projection` is
                    # stored transposed): it replaces the raw alias instead of making the name ambiguous.
                    renamed = {a.name for a in extra}
                    aliases = [a for a in aliases if a.name not in renamed] + extra
                    break
        for alias in aliases:
            targets = tuple(replace(t, key=part.prefix + t.key) for t in alias.targets)
            for name in _spellings(part, alias.name):
                km._add(name, targets)
    return km


def _is_bias(key: str) -> bool:
    return key.endswith((".bias", "_bias"))


def _spellings(part: Part, name: str) -> list[str]:
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


def _parts(base: Shapes, component: str | None) -> list[Part]:
    if component:
        comp = component.strip("/")
        part = Part("", comp + "/", dict(base), standalone=True)
        _assign_role(part, comp + "/")
        if part.role == "other" and comp != "vae":
            part.role = "te" if _te_kind(part.keys) else "dm"
        if part.role == "te" and not part.te_numbers:
            _standalone_te(part)
        return [part]

    groups: dict[str, Part] = {}
    for key, shape in base.items():
        m = FILE_PREFIX.match(key)
        prefix = m.group(0) if m else ""
        identity = (m.group(1) or m.group(2)) if m else ""
        part = groups.get(prefix)
        if part is None:
            part = groups[prefix] = Part(prefix, identity, {})
        part.keys[key[len(prefix):]] = shape
    parts = list(groups.values())
    for part in parts:
        _assign_role(part, part.identity)
    top = groups.get("")
    if top is not None:
        others = [p for p in parts if p is not top and p.role != "other"]
        if not others:
            top.standalone = True
            top.role = "te" if _te_kind(top.keys) else "dm"
            if top.role == "te":
                _standalone_te(top)
        elif not any(p.role == "dm" for p in others) and not _te_kind(top.keys):
            top.role = "dm"
    _number_text_encoders([p for p in parts if p.role == "te" and not p.te_numbers])
    return parts


def _assign_role(part: Part, identity: str):
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
        part.te_numbers = (n, 3) if n == 2 and _te_kind(part.keys) == "t5" else (n,)
    elif identity == "cond_stage_model.":
        part.te_numbers = (1,)
    if part.te_numbers and part.te_numbers[0] == 1:
        part.plain_te = True


def _te_kind(keys: Shapes) -> str | None:
    """"clip_l" / "clip_g" (HF CLIP or OpenCLIP, by width), "t5", or None for anything else."""
    if openclip.is_openclip(keys):
        return "clip_g" if openclip.width(keys) == 1280 else "clip_l"
    if any(k.startswith("text_model.encoder.layers.") for k in keys) or hf_clip.is_unwrapped(keys):
        ln = keys.get("text_model.final_layer_norm.weight") or keys.get("final_layer_norm.weight")
        return "clip_g" if ln and ln[0] == 1280 else "clip_l"
    if any(k.startswith("encoder.block.") for k in keys):
        return "t5"
    return None


def _standalone_te(part: Part):
    """A lone text-encoder file: numbers under which kohya/diffusers name this kind of encoder."""
    kind = _te_kind(part.keys)
    part.te_numbers = {"clip_g": (2,), "t5": (1, 2, 3)}.get(kind, (1,))
    part.plain_te = True


def _number_text_encoders(parts: list[Part]):
    """kohya numbers for `text_encoders.NAME.` parts: CLIP-L first, CLIP-G next, T5 last (SD3: te1-te3;
    Flux, CLIP-L + T5: T5 answers to both te2 (OneTrainer) and te3 (kohya))."""
    by_identity: dict[str, list[Part]] = {}
    for p in parts:
        by_identity.setdefault(p.identity, []).append(p)
    order = {"clip_l": 0, "clip_g": 1, "t5": 2, None: 3}
    kinds = {}
    for ident, ps in by_identity.items():
        name = ident.split(".")[1] if ident.startswith("text_encoders.") else ""
        kind = next((k for k in (_te_kind(p.keys) for p in ps) if k), None)
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
