"""File prefixes under which a single-file checkpoint stores its diffusion model: the one list that
`convert --layout`/`--to comfy-*`, `inspect` and `merge-lora` read.

- `model.diffusion_model.`: LDM/SGM all-in-one files and ComfyUI's default for saving
  (`supported_models_base.BASE.process_unet_state_dict_for_saving`);
- `model.model.`: what ComfyUI's ModelSave/CheckpointSave write for the model classes that override that
  method: HunyuanVideo (and its I2V, SkyReels and HunyuanImage 2.1 subclasses) and StableAudio
  (ComfyUI `comfy/supported_models.py`; its loader lists the same prefix in `unet_prefix_from_state_dict`);
- `diffusion_model.`: the same without the outer `model.`.

`model.model.` is guarded: a PyTorch Lightning (or similar) wrapper around a Hugging Face language model
writes `model.model.layers.N...` too, so the prefix counts only where the keys under it are recognised as
a diffusion model (a family whose `kind` is "diffusion"); otherwise the keys are left as they are.
"""

from __future__ import annotations

# prefix -> what inspect says it is; longest match wins where two apply.
MODEL_PREFIXES: dict[str, str] = {
    "model.diffusion_model.": "diffusion model, LDM/ComfyUI",
    "model.model.": "diffusion model, ComfyUI ModelSave",
    "diffusion_model.": "diffusion model",
}
GUARDED = frozenset({"model.model."})  # also used by non-diffusion wrappers: checked against the family


def accepts(prefix: str, inner, inner_shapes=None) -> bool:
    """Whether the keys under `prefix` (`inner`: names without the prefix; `inner_shapes` where known)
    are a diffusion model there: always for the unambiguous prefixes, for a guarded one only when they
    are a diffusion family."""
    if prefix not in GUARDED:
        return True
    from ckpt import families

    m = families.detect(inner, inner_shapes or {})
    return m is not None and m.family.kind == "diffusion"


def under(prefix: str, keys, shapes) -> tuple[list[str], dict]:
    """The keys starting with `prefix`, and their shapes, with the prefix stripped."""
    inner = [k[len(prefix):] for k in keys if k.startswith(prefix)]
    return inner, {k[len(prefix):]: s for k, s in (shapes or {}).items() if k.startswith(prefix)}


def model_prefix(keys, shapes=None) -> str:
    """The model prefix some of `keys` carry ("" when none, or when a guarded one is not a diffusion
    model); the list's order decides between prefixes, as the callers have always done."""
    keys = list(keys)
    for prefix in MODEL_PREFIXES:
        inner, inner_shapes = under(prefix, keys, shapes)
        if inner and accepts(prefix, inner, inner_shapes):
            return prefix
    return ""
