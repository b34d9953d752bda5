"""Z-Image (Turbo, Base, Omni; Tongyi-MAI): original layout (the reference `ZImageTransformer2DModel` of
the Z-Image repository, as in ComfyUI single files such as `z_image_turbo_bf16.safetensors`) <-> diffusers
ZImageTransformer2DModel.

The two layouts share most names (`layers.N.feed_forward.w1/w2/w3`, `attention_norm1/2`, `ffn_norm1/2`,
`adaLN_modulation.0`, `t_embedder.mlp`, `cap_embedder`, the pad tokens). They differ in the attention of
every block (`layers`, `noise_refiner`, `context_refiner`, Omni's `siglip_refiner`): the original fused
`attention.qkv` is diffusers' `to_q/to_k/to_v` (equal thirds: no grouped kv heads in any release),
`attention.out` is `to_out.0`, `q_norm/k_norm` are `norm_q/norm_k`; and diffusers keys the patch
embedder and final layer by patch size: `x_embedder`/`final_layer` are `all_x_embedder.2-1`/
`all_final_layer.2-1` (patch 2, frame patch 1, the only one released). The original's unused
`norm_final.weight` has no diffusers tensor. Reference: diffusers
`convert_z_image_transformer_checkpoint_to_diffusers` (there is no reverse converter).

Recognition: the original names are Lumina 2's (Z-Image grew out of it); Z-Image's blocks modulate with
`adaLN_modulation.0` (Lumina 2: `.1`), it has `x_pad_token`/`cap_pad_token`, and its `qkv` has 3 x its
columns in rows (Lumina 2 groups kv heads). LoRA names with none of these read as Lumina 2.

LoRAs: musubi-tuner, ai-toolkit and DiffSynth train on diffusers' module tree, so kohya-style
`lora_unet_layers_0_attention_to_q` names are diffusers names (`kohya_layout` diffusers); ComfyUI-trained
LoRAs use the original `attention.qkv`/`attention.out`. Either lands on either layout: a `to_q/k/v` LoRA
on thirds of `attention.qkv`, a `qkv` LoRA on the three diffusers pieces.
"""

from __future__ import annotations

from ckpt.families.spec import (DIFFUSERS, ORIGINAL, ConventionError, Family, GGUFStorage, Pair, Shapes, Signature,
                                block_indices, blocks_count, has, present, renames, start, thirds)

BLOCK_HEADS = ("layers", "noise_refiner", "context_refiner", "siglip_refiner")
# Same name in both layouts.
SAME_TOP = ("t_embedder.mlp.0", "t_embedder.mlp.2", "cap_embedder.1", "siglip_embedder.1")
SAME_TOP_NORMS = ("cap_embedder.0", "siglip_embedder.0")
SAME_PARAMS = ("x_pad_token", "cap_pad_token", "siglip_pad_token")
SAME_BLOCK = ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3", "adaLN_modulation.0")
SAME_BLOCK_NORMS = ("attention_norm1", "attention_norm2", "ffn_norm1", "ffn_norm2")
ATTN = (("attention.out", "attention.to_out.0"),)
ATTN_NORMS = (("attention.q_norm", "attention.norm_q"), ("attention.k_norm", "attention.norm_k"))
FINAL = ("linear", "adaLN_modulation.1")
PATCH = "2-1"  # diffusers' key of the patch-2, frame-patch-1 embedder: the one a release has

_HEADS = "(" + "|".join(BLOCK_HEADS) + r")_.\d+_."
ORIGINAL_NAMES = start(_HEADS + r"attention_.(qkv|out|q_norm|k_norm)")
DIFFUSERS_NAMES = start(rf"({_HEADS}attention_.(to_q|to_k|to_v|to_out|norm_q|norm_k)|all_(x_embedder|final_layer)_.)")
# Z-Image, not Lumina 2: blocks modulated by `adaLN_modulation.0`, pad tokens.
Z_IMAGE_NAMES = start(r"((layers|noise_refiner)_.\d+_.adaLN_modulation_.0|(x|cap)_pad_token)")


def z_image_evidence(keys, shapes: Shapes) -> bool:
    """Z-Image by names, or by an ungrouped fused qkv (rows = 3 x columns; Lumina 2: q + 2 kv rows)."""
    if has(keys, Z_IMAGE_NAMES):
        return True
    for k in has(keys, start(_HEADS + r"attention_.qkv(\.weight)?$")):
        s = shapes.get(k)
        if s is not None and len(s) == 2:
            return s[0] == 3 * s[1]
    return False


def identify(keys, shapes, layout):
    variant = "Omni " if has(keys, start(r"siglip_")) else ""
    where = "(original)" if layout == ORIGINAL else "(diffusers ZImageTransformer2DModel)"
    return "z_image", f"Z-Image {variant}transformer {where}"


def _patch_key(shapes: Shapes, layout: str) -> str:
    """The diffusers patch key paired with the original `x_embedder`/`final_layer`: diffusers' converter
    uses "2-1"; a diffusers model with one other patch size pairs that one."""
    if layout == DIFFUSERS:
        found = sorted({k.split(".")[1] for k in shapes if k.startswith("all_x_embedder.")})
        if len(found) == 1:
            return found[0]
    return PATCH


def pairs_for(blocks: dict[str, dict[int, int]], patch: str) -> list[Pair]:
    """Original <-> diffusers tensors for blocks {head: {index: width}}."""
    out = [Pair(f"x_embedder.{e}", f"all_x_embedder.{patch}.{e}") for e in ("weight", "bias")]
    out += renames([(f"final_layer.{m}", f"all_final_layer.{patch}.{m}") for m in FINAL])
    out += renames([(m, m) for m in SAME_TOP])
    out += renames([(m, m) for m in SAME_TOP_NORMS], ends=("weight",))
    out += [Pair(p, p) for p in SAME_PARAMS]
    out.append(Pair("norm_final.weight", None))
    for head, widths in blocks.items():
        for i, h in widths.items():
            b = f"{head}.{i}."
            if h:
                out += [Pair(f"{b}attention.qkv.weight", f"{b}attention.{n}.weight", rows)
                        for rows, n in zip(thirds(0, h), ("to_q", "to_k", "to_v"))]
            out += renames(ATTN, b, b)
            out += renames(ATTN_NORMS, b, b, ends=("weight",))
            out += renames([(m, m) for m in SAME_BLOCK], b, b)
            out += renames([(m, m) for m in SAME_BLOCK_NORMS], b, b, ends=("weight",))
    return out


def widths(shapes: Shapes, layout: str) -> dict[str, dict[int, int]]:
    """{block head: {index: q/k/v width}} (0 where the block has no attention weights)."""
    out = {}
    for head in BLOCK_HEADS:
        found = {}
        for i in block_indices(shapes, head):
            if layout == ORIGINAL:
                qkv = shapes.get(f"{head}.{i}.attention.qkv.weight")
                found[i] = qkv[0] // 3 if qkv else 0
            else:
                q = shapes.get(f"{head}.{i}.attention.to_q.weight")
                found[i] = q[0] if q else 0
        out[head] = found
    return out


def pairs(shapes: Shapes, layout: str) -> list[Pair]:
    return present(pairs_for(widths(shapes, layout), _patch_key(shapes, layout)), shapes, layout)


# What the weights do not say (the ZImageTransformer2DModel config of Tongyi-MAI/Z-Image-Turbo and
# Z-Image): rope axes (they must add up to the head size), rope lengths and theta, time scale, norm eps.
CONVENTIONS = {"axes_dims": {128: [32, 48, 48]}, "axes_lens": [1536, 512, 512], "rope_theta": 256.0,
               "t_scale": 1000.0, "norm_eps": 1e-05}


def diffusers_config(s: Shapes) -> dict:
    head = s.get("layers.0.attention.norm_q.weight")
    if head is None:
        raise ConventionError("Z-Image without q/k norms has no head size in its weights")
    head = head[0]
    axes = CONVENTIONS["axes_dims"].get(head)
    if axes is None:
        raise ConventionError(f"Z-Image's rope axes are known for an attention head size of 128, not {head}")
    patches = sorted({k.split(".")[1] for k in s if k.startswith("all_x_embedder.")})
    sizes = [tuple(int(x) for x in p.split("-")) for p in patches]
    width, cols = s[f"all_x_embedder.{patches[0]}.weight"]
    p, f = sizes[0]
    siglip = s.get("siglip_embedder.1.weight")
    return {
        "_class_name": "ZImageTransformer2DModel",
        "all_patch_size": [p for p, _ in sizes],
        "all_f_patch_size": [f for _, f in sizes],
        "in_channels": cols // (f * p * p),
        "dim": width,
        "n_layers": blocks_count(s, "layers"),
        "n_refiner_layers": blocks_count(s, "noise_refiner"),
        "n_heads": width // head,
        "n_kv_heads": s["layers.0.attention.to_k.weight"][0] // head,
        "norm_eps": CONVENTIONS["norm_eps"],
        "qk_norm": True,
        "cap_feat_dim": s["cap_embedder.1.weight"][1],
        "siglip_feat_dim": siglip[1] if siglip else None,
        "rope_theta": CONVENTIONS["rope_theta"],
        "t_scale": CONVENTIONS["t_scale"],
        "axes_dims": axes,
        "axes_lens": CONVENTIONS["axes_lens"],
    }


FAMILY = Family(
    family_id="z_image",
    label="Z-Image",
    layouts={
        ORIGINAL: Signature(ORIGINAL_NAMES, check=z_image_evidence),
        DIFFUSERS: Signature(DIFFUSERS_NAMES),
    },
    identify=identify,
    diffusers_class="ZImageTransformer2DModel",
    pairs=pairs,
    diffusers_config=diffusers_config,
    kohya_layout=DIFFUSERS,
    lora_namings=("musubi-tuner/ai-toolkit/kohya (diffusers names)", "ComfyUI (original names)", "diffusers/PEFT",
                  "DiffSynth", "OneTrainer", "SimpleTuner LyCORIS"),
    # ComfyUI-GGUF's rule for this architecture (which it shares with Lumina 2): the input and output layers,
    # the timestep and caption embedders, the pad tokens and the two refiners (noise, context) stay unquantized.
    high_precision={
        ORIGINAL: (r"^(x_embedder|final_layer|t_embedder|cap_embedder|siglip_embedder|noise_refiner|context_refiner)"
                   r"\.", r"_pad_token$"),
        DIFFUSERS: (r"^(all_x_embedder|all_final_layer|t_embedder|cap_embedder|siglip_embedder|noise_refiner"
                    r"|context_refiner)\.", r"_pad_token$"),
    },
    gguf=GGUFStorage("lumina2", f32=(r"^(x|cap)_pad_token$",)),  # ComfyUI-GGUF: Lumina 2's architecture
    blocks=(r"^layers\.(\d+)\.",),
)
