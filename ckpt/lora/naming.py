"""The module names an extracted LoRA gets, derived from the base's own keys.

Each base weight becomes one or more *pieces*: a module name in the output's naming and the part of
the weight it covers (all of it, a row slice of a fused weight, or the weight with a transform). The
names are chosen among the spellings the merge key map (`ckpt.merge.keymap`) registers for that base
weight, and every chosen name is checked to resolve back through that key map to exactly the same
piece: what `ckpt lora extract` writes, `ckpt merge-lora` merges into the same base, by construction.

- peft: the module path itself (one model per adapter folder).
- kohya: `lora_unet_` + the diffusion model's path with `.` -> `_` (SD1/SD2 LDM UNets under their
  diffusers names, as kohya's own SD1/SD2 LoRAs; SDXL, Flux, SD3 under their own names), text
  encoders `lora_te{N}_` + the Hugging Face CLIP path (OpenCLIP's fused q/k/v split into q_proj,
  k_proj, v_proj rows), `lora_te_` when the base has a single text encoder.
- diffusers: `PREFIX.` + the path in a diffusers/transformers layout base (PREFIX from the pipeline
  component or the model's config class).

A weight that has no name in the chosen naming (a VAE weight in a kohya LoRA, a text encoder in a
PEFT folder, an original-layout base for diffusers naming) carries the reason instead; it is an error
only when that weight actually changed.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckpt.merge.keymap import FAMILIES, build_keymap
from ckpt.merge.keymaps import module_of
from ckpt.merge.targets import Target

SDXL_LABEL_EMB_IN = 2816


@dataclass(frozen=True)
class Piece:
    """The part of a base weight one output module covers."""

    name: str  # module name in the output naming (no role suffix)
    rows: tuple[int, int] | None = None  # rows [start, stop) of a fused weight
    transform: str | None = None  # "swap_halves" | "transpose" | None (ckpt.merge.targets)

    def of(self, delta):
        """This piece's delta, in its module's own layout, from the whole weight's 2-D delta."""
        d = delta if self.rows is None else delta[self.rows[0]:self.rows[1]]
        if self.transform == "transpose":
            return d.mT
        if self.transform == "swap_halves":
            h = d.shape[0] // 2
            import torch

            return torch.cat([d[h:], d[:h]])
        return d


class Naming:
    """Pieces of every base weight of one component in one output naming."""

    def __init__(self, fmt: str, shapes: dict[str, tuple[int, ...]], component: str, config: dict | None,
                 single_component: bool):
        from ckpt.merge import keymap as km_mod

        self.fmt = fmt
        self.km = build_keymap(shapes, component or None)
        self._pieces: dict[str, list[Piece] | str | None] = {}
        self.prefixes: set[str] = set()
        parts = km_mod._parts(shapes, component or None)
        te_parts = [p for p in parts if p.role == "te"]
        for part in parts:
            self._name_part(part, shapes, component, config, single_component, len(te_parts), km_mod)

    def pieces(self, key: str) -> list[Piece] | str | None:
        """The pieces of base weight `key`; a string says why it has no name in this naming; None: the
        weight is outside every model a LoRA adapts (VAE, EMA copy), not extracted."""
        return self._pieces.get(key, f"{self.fmt} naming has no name for {key!r}")

    # -- building ------------------------------------------------------------------------------------
    def _name_part(self, part, shapes, component, config, single_component, n_te, km_mod):
        family, aliases = None, None
        if part.role != "other":
            for label, make in FAMILIES:
                found = make(part.keys)
                if found is not None:
                    family, aliases = label, found
                    break
        keys = [k for k in part.keys if k.endswith(".weight") or k in ("text_projection",)]
        if part.role == "other":  # VAE, EMA copies, image encoders: not what LoRAs adapt
            for k in keys:
                self._pieces[part.prefix + k] = None
            return
        if self.fmt == "peft":
            self._peft(part, keys, single_component)
        elif self.fmt == "kohya":
            self._kohya(part, keys, family, aliases, n_te)
        else:
            self._diffusers(part, keys, component, config)

    def _set(self, part, key: str, pieces: list[Piece]):
        """Record the pieces of a weight if every name resolves back to the same piece."""
        full = part.prefix + key
        for p in pieces:
            want = Target(full, p.rows, p.transform)
            got = self.km.targets(p.name)
            if got != [want]:
                self._pieces[full] = (f"the {self.fmt} name {p.name!r} for {full!r} would not merge back "
                                      "into the same weight (ambiguous in this base)")
                return
        self._pieces[full] = pieces

    def _peft(self, part, keys, single_component):
        if not part.standalone or not single_component:
            for k in keys:
                self._pieces[part.prefix + k] = ("a PEFT adapter folder holds one model; this base holds several "
                                                 "(use --format kohya, or extract from the model's own folder)")
            return
        for k in keys:
            self._set(part, k, [Piece("base_model.model." + part.prefix + module_of(k))])

    def _kohya(self, part, keys, family, aliases, n_te):
        by_target: dict[str, list[tuple[str, Target]]] = {}
        use_aliases = (family == "SD UNet" and _is_sd12_ldm(part.keys)) or family in (
            "OpenCLIP text", "CLIP text (no text_model. wrapper)")
        if use_aliases:
            for a in aliases:
                if len(a.targets) == 1 and ".processor." not in a.name:
                    by_target.setdefault(a.targets[0].key, []).append((a.name, a.targets[0]))
        if part.role == "dm":
            head = "lora_unet_"
        else:
            head = "lora_te_" if part.plain_te and n_te == 1 else f"lora_te{max(part.te_numbers or (1,))}_"
        for k in keys:
            named = by_target.get(k)
            if named:
                rows_seen, pieces = set(), []
                for name, t in named:  # one name per piece: the first alias of each row range
                    if (t.rows, t.transform) in rows_seen:
                        continue
                    rows_seen.add((t.rows, t.transform))
                    pieces.append(Piece(head + name.replace(".", "_"), t.rows, t.transform))
                self._set(part, k, pieces)
            elif not use_aliases or family != "OpenCLIP text":
                self._set(part, k, [Piece(head + module_of(k).replace(".", "_"))])
            else:
                self._pieces[part.prefix + k] = f"kohya LoRAs have no module for {part.prefix + k!r}"

    def _diffusers(self, part, keys, component, config):
        prefix = _diffusers_prefix(component, config, part)
        if prefix is None:
            for k in keys:
                self._pieces[part.prefix + k] = (
                    "diffusers naming needs a base in diffusers/transformers layout (a pipeline or model folder "
                    "with its config.json); this base is in its original layout (use --format kohya)")
            return
        self.prefixes.add(prefix)
        for k in keys:
            self._set(part, k, [Piece(prefix + "." + module_of(k))])


def _is_sd12_ldm(keys) -> bool:
    """An SD1/SD2 LDM UNet (kohya names these by their diffusers names; SDXL by their own)."""
    if not any(k.startswith("input_blocks.") for k in keys):
        return False
    emb = keys.get("label_emb.0.0.weight")
    return not (emb and len(emb) == 2 and emb[1] == SDXL_LABEL_EMB_IN)


def _diffusers_prefix(component: str, config: dict | None, part) -> str | None:
    """`unet` / `transformer` / `text_encoder[_N]` for a component in diffusers layout, else None."""
    comp = (component or "").strip("/")
    if comp in ("unet", "transformer", "prior", "decoder") or comp.startswith("text_encoder"):
        return comp
    if part.prefix or not config:
        return None
    cls = str(config.get("_class_name") or "")
    arch = " ".join(config.get("architectures") or [])
    if "UNet" in cls:
        return "unet"
    if cls:
        return "transformer"
    if "CLIPText" in arch:
        return "text_encoder"
    if "T5" in arch:
        return "text_encoder_2"
    return None
