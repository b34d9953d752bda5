"""Lumina-Image 2.0 (Alpha-VLLM; also Neta Lumina and other fine-tunes): original layout (the `NextDiT` of
Lumina-Image-2.0, as in ComfyUI single files and kohya sd-scripts' Lumina training) <-> diffusers
Lumina2Transformer2DModel.

Every block (`layers`, `noise_refiner`, `context_refiner`) fuses its attention projections in
`attention.qkv`: grouped-query attention, so the rows are q (the width), then k and v (kv heads x head
size each; 2304 + 768 + 768 in the release). The q width is read from `attention.out` (its columns), the
kv width from the rest. Renames: `attention` -> `attn`, `out` -> `to_out.0`, `q_norm/k_norm` ->
`norm_q/norm_k`, `feed_forward.w1/w2/w3` -> `feed_forward.linear_1/2/3`, `adaLN_modulation.1` ->
`norm1.linear`, `attention_norm1` -> `norm1.norm` (`norm1` in the unmodulated context refiner),
`attention_norm2` -> `norm2`; `t_embedder.mlp.0/.2` -> `time_caption_embed.timestep_embedder.linear_1/2`,
`cap_embedder` -> `time_caption_embed.caption_embedder`, `final_layer.adaLN_modulation.1`/
`final_layer.linear` -> `norm_out.linear_1`/`linear_2` (no halves to swap: it is a scale only). The
original's unused `norm_final.weight` has no diffusers tensor. Reference: diffusers
`convert_lumina2_to_diffusers` (which hard-codes the release's 2304/768 split; no reverse converter).

Recognition: Z-Image shares the original names (`ckpt.families.z_image` tells them apart); names alone
that could be either read as Lumina 2.

LoRAs: kohya sd-scripts (`lora_unet_layers_0_attention_qkv`) and ComfyUI (`diffusion_model.`) name the
original modules, diffusers/PEFT/SimpleTuner the diffusers ones; a LoRA on `qkv` lands on `to_q/k/v` and
one on `to_q/k/v` on the q or kv rows of `qkv`.
"""

from __future__ import annotations

from ckpt.families.spec import (DIFFUSERS, ORIGINAL, ConventionError, Family, GGUFStorage, Pair, Shapes, Signature,
                                block_indices, blocks_count, present, renames, start)
from ckpt.families.z_image import ORIGINAL_NAMES, z_image_evidence

BLOCK_HEADS = ("layers", "noise_refiner", "context_refiner")
TOP = (
    ("x_embedder", "x_embedder"),
    ("t_embedder.mlp.0", "time_caption_embed.timestep_embedder.linear_1"),
    ("t_embedder.mlp.2", "time_caption_embed.timestep_embedder.linear_2"),
    ("cap_embedder.1", "time_caption_embed.caption_embedder.1"),
    ("final_layer.adaLN_modulation.1", "norm_out.linear_1"),
    ("final_layer.linear", "norm_out.linear_2"),
)
BLOCK = (
    ("attention.out", "attn.to_out.0"),
    ("feed_forward.w1", "feed_forward.linear_1"),
    ("feed_forward.w2", "feed_forward.linear_2"),
    ("feed_forward.w3", "feed_forward.linear_3"),
    ("adaLN_modulation.1", "norm1.linear"),
)
BLOCK_NORMS = (
    ("attention.q_norm", "attn.norm_q"),
    ("attention.k_norm", "attn.norm_k"),
    ("attention_norm2", "norm2"),
    ("ffn_norm1", "ffn_norm1"),
    ("ffn_norm2", "ffn_norm2"),
)

DIFFUSERS_NAMES = start(r"((layers|noise_refiner|context_refiner)_.\d+_.(attn_.(to_q|to_k|to_v|to_out|norm_q|norm_k)"
                        r"|feed_forward_.linear_[123])|time_caption_embed_.)")


def _lumina(keys, shapes) -> bool:
    return not z_image_evidence(keys, shapes)


def identify(keys, shapes, layout):
    return "lumina2", "Lumina-Image 2.0 transformer " + ("(original)" if layout == ORIGINAL
                                                          else "(diffusers Lumina2Transformer2DModel)")


def pairs_for(blocks: dict[str, dict[int, tuple[int, int]]]) -> list[Pair]:
    """Original <-> diffusers tensors for blocks {head: {index: (q width, kv width)}}."""
    out = renames(TOP)
    out.append(Pair("cap_embedder.0.weight", "time_caption_embed.caption_embedder.0.weight"))
    out.append(Pair("norm_final.weight", None))
    for head, found in blocks.items():
        for i, (q, kv) in found.items():
            b = f"{head}.{i}."
            if q:
                spans = ((0, q), (q, q + kv), (q + kv, q + 2 * kv))
                out += [Pair(f"{b}attention.qkv.weight", f"{b}attn.{n}.weight", rows)
                        for rows, n in zip(spans, ("to_q", "to_k", "to_v"))]
            out += renames(BLOCK, b, b)
            norm1 = "norm1" if head == "context_refiner" else "norm1.norm"
            out += renames(BLOCK_NORMS + (("attention_norm1", norm1),), b, b, ends=("weight",))
    return out


def widths(shapes: Shapes, layout: str) -> dict[str, dict[int, tuple[int, int]]]:
    """{block head: {index: (q width, kv width)}}; (0, 0) where a block's attention weights are missing."""
    out = {}
    for head in BLOCK_HEADS:
        found = {}
        for i in block_indices(shapes, head):
            b = f"{head}.{i}."
            if layout == ORIGINAL:
                qkv, o = shapes.get(f"{b}attention.qkv.weight"), shapes.get(f"{b}attention.out.weight")
                found[i] = (o[1], (qkv[0] - o[1]) // 2) if qkv and o and len(o) == 2 else (0, 0)
            else:
                q, k = shapes.get(f"{b}attn.to_q.weight"), shapes.get(f"{b}attn.to_k.weight")
                found[i] = (q[0], k[0]) if q and k else (0, 0)
        out[head] = found
    return out


def pairs(shapes: Shapes, layout: str) -> list[Pair]:
    return present(pairs_for(widths(shapes, layout)), shapes, layout)


# What the weights do not say (the Lumina2Transformer2DModel config of Alpha-VLLM/Lumina-Image-2.0): patch
# size, rope axes (they add up to the head size) and lengths, sample size, norm eps, scaling factor, and how
# the feed-forward width was rounded (multiple_of / ffn_dim_multiplier: the release's 256 / None, else the
# simplest pair that gives the width the weights have).
CONVENTIONS = {"patch_size": 2, "axes_dim_rope": {96: [32, 32, 32]}, "axes_lens": [300, 512, 512],
               "sample_size": 128, "norm_eps": 1e-05, "scaling_factor": 1.0, "multiple_of": 256}


def _ffn_rounding(width: int, inner: int) -> tuple[int, float | None]:
    """(multiple_of, ffn_dim_multiplier) for which LuminaFeedForward makes `inner` from 4 x `width`."""
    base = 4 * width

    def makes(multiple_of, mult):
        n = int(mult * base) if mult is not None else base
        return multiple_of * ((n + multiple_of - 1) // multiple_of) == inner

    for multiple_of, mult in ((CONVENTIONS["multiple_of"], None), (CONVENTIONS["multiple_of"], inner / base),
                              (1, inner / base)):
        if makes(multiple_of, mult):
            return multiple_of, mult
    raise ConventionError(f"no multiple_of/ffn_dim_multiplier gives a feed-forward width of {inner} from {width}")


def diffusers_config(s: Shapes) -> dict:
    head = s["layers.0.attn.norm_q.weight"][0]
    axes = CONVENTIONS["axes_dim_rope"].get(head)
    if axes is None:
        raise ConventionError(f"Lumina 2's rope axes are known for an attention head size of 96, not {head}")
    width, cols = s["x_embedder.weight"]
    p = CONVENTIONS["patch_size"]
    in_ch, out_ch = cols // (p * p), s["norm_out.linear_2.weight"][0] // (p * p)
    multiple_of, mult = _ffn_rounding(width, s["layers.0.feed_forward.linear_1.weight"][0])
    return {
        "_class_name": "Lumina2Transformer2DModel",
        "sample_size": CONVENTIONS["sample_size"],
        "patch_size": p,
        "in_channels": in_ch,
        "out_channels": None if out_ch == in_ch else out_ch,
        "hidden_size": width,
        "num_layers": blocks_count(s, "layers"),
        "num_refiner_layers": blocks_count(s, "noise_refiner"),
        "num_attention_heads": s["layers.0.attn.to_q.weight"][0] // head,
        "num_kv_heads": s["layers.0.attn.to_k.weight"][0] // head,
        "multiple_of": multiple_of,
        "ffn_dim_multiplier": mult,
        "norm_eps": CONVENTIONS["norm_eps"],
        "scaling_factor": CONVENTIONS["scaling_factor"],
        "axes_dim_rope": axes,
        "axes_lens": CONVENTIONS["axes_lens"],
        "cap_feat_dim": s["time_caption_embed.caption_embedder.1.weight"][1],
    }


FAMILY = Family(
    family_id="lumina2",
    label="Lumina-Image 2.0",
    layouts={
        ORIGINAL: Signature(ORIGINAL_NAMES, check=_lumina),
        DIFFUSERS: Signature(DIFFUSERS_NAMES),
    },
    identify=identify,
    diffusers_class="Lumina2Transformer2DModel",
    pairs=pairs,
    diffusers_config=diffusers_config,
    kohya_layout=ORIGINAL,
    lora_namings=("kohya sd-scripts (original names)", "ComfyUI", "diffusers/PEFT", "OneTrainer",
                  "SimpleTuner LyCORIS"),
    # ComfyUI-GGUF's rule: the input and output layers, the timestep and caption embedders and the two
    # refiners (noise, context) stay unquantized.
    high_precision={
        ORIGINAL: (r"^(x_embedder|t_embedder|cap_embedder|final_layer|noise_refiner|context_refiner)\.",),
        DIFFUSERS: (r"^(x_embedder|time_caption_embed|norm_out|noise_refiner|context_refiner)\.",),
    },
    gguf=GGUFStorage("lumina2", f32=(r"^(x|cap)_pad_token$",)),
    blocks=(r"^layers\.(\d+)\.",),
)
