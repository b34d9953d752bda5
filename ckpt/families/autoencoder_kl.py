"""Image VAEs (AutoencoderKL: SD1/SD2/SDXL 4-channel latents, SD3/Flux.1 16-channel): LDM names
(`encoder.down.0.block.0`, the "original" layout, `first_stage_model.` in single files, `vae.` in
ComfyUI bundles) <-> diffusers AutoencoderKL (`encoder.down_blocks.0.resnets.0`).

Encoder levels keep their order; decoder levels are numbered the other way round (LDM `up.{n-1-i}` is
diffusers `up_blocks.{i}`). The mid-block attention's q/k/v/proj_out are 1x1 convolutions in LDM and
linear layers in diffusers (`squeeze`). Reference: diffusers `convert_ldm_vae_checkpoint`.
"""

from __future__ import annotations

from ckpt.families.spec import (DIFFUSERS, ORIGINAL, ConventionError, Family, Pair, Shapes, Signature, at, blocks_count, dim,
                                present)

TOP = (
    ("encoder.conv_in", "encoder.conv_in"), ("encoder.conv_out", "encoder.conv_out"),
    ("encoder.norm_out", "encoder.conv_norm_out"), ("decoder.conv_in", "decoder.conv_in"),
    ("decoder.conv_out", "decoder.conv_out"), ("decoder.norm_out", "decoder.conv_norm_out"),
    ("quant_conv", "quant_conv"), ("post_quant_conv", "post_quant_conv"),
)
RESNET = (("norm1", "norm1"), ("conv1", "conv1"), ("norm2", "norm2"), ("conv2", "conv2"),
          ("nin_shortcut", "conv_shortcut"))
ATTN = (("norm", "group_norm", None), ("q", "to_q", "squeeze"), ("k", "to_k", "squeeze"), ("v", "to_v", "squeeze"),
        ("proj_out", "to_out.0", "squeeze"))
ENDS = ("weight", "bias")


def _resnet(o: str, d: str) -> list[Pair]:
    return [Pair(f"{o}.{a}.{e}", f"{d}.{b}.{e}") for a, b in RESNET for e in ENDS]


def pairs_for(levels: int, resnets: dict[str, int]) -> list[Pair]:
    out = [Pair(f"{o}.{e}", f"{d}.{e}") for o, d in TOP for e in ENDS]
    for side in ("encoder", "decoder"):
        for j in (1, 2):
            out += _resnet(f"{side}.mid.block_{j}", f"{side}.mid_block.resnets.{j - 1}")
        for o, d, t in ATTN:
            out += [Pair(f"{side}.mid.attn_1.{o}.weight", f"{side}.mid_block.attentions.0.{d}.weight", transform=t),
                    Pair(f"{side}.mid.attn_1.{o}.bias", f"{side}.mid_block.attentions.0.{d}.bias")]
    for i in range(levels):
        for j in range(resnets["encoder"]):
            out += _resnet(f"encoder.down.{i}.block.{j}", f"encoder.down_blocks.{i}.resnets.{j}")
        out += [Pair(f"encoder.down.{i}.downsample.conv.{e}", f"encoder.down_blocks.{i}.downsamplers.0.conv.{e}")
                for e in ENDS]
        o = levels - 1 - i
        for j in range(resnets["decoder"]):
            out += _resnet(f"decoder.up.{o}.block.{j}", f"decoder.up_blocks.{i}.resnets.{j}")
        out += [Pair(f"decoder.up.{o}.upsample.conv.{e}", f"decoder.up_blocks.{i}.upsamplers.0.conv.{e}")
                for e in ENDS]
    return out


def pairs(shapes: Shapes, layout: str) -> list[Pair]:
    if layout == ORIGINAL:
        levels = blocks_count(shapes, "encoder.down")
        resnets = {"encoder": blocks_count(shapes, "encoder.down.0.block"),
                   "decoder": blocks_count(shapes, "decoder.up.0.block")}
    else:
        levels = blocks_count(shapes, "encoder.down_blocks")
        resnets = {"encoder": blocks_count(shapes, "encoder.down_blocks.0.resnets"),
                   "decoder": blocks_count(shapes, "decoder.up_blocks.0.resnets")}
    return present(pairs_for(levels, resnets), shapes, layout)


def diffusers_config(s: Shapes) -> dict:
    """A VAE's config.json is not derived: its latent scaling differs between releases of the same shapes."""
    raise ConventionError("a VAE's latent scaling factor is not in its weights (SD1/SD2 0.18215, SDXL 0.13025, "
                          "SD3 1.5305, Flux.1 0.3611)")


def identify(keys, shapes, layout):
    z = dim(shapes, keys, at(r"encoder_.conv_out\.weight$"), 0)
    latents = f", {z // 2}-channel latents" if z else ""
    return "autoencoder_kl", f"VAE ({'diffusers AutoencoderKL' if layout == DIFFUSERS else 'LDM'}{latents})"


FAMILY = Family(
    family_id="autoencoder_kl",
    kind="vae",
    label="VAE (AutoencoderKL)",
    layouts={
        ORIGINAL: Signature(at(r"(encoder_.down_.\d+_.block|decoder_.up_.\d+_.block)_.")),
        DIFFUSERS: Signature(at(r"(encoder_.down_blocks_.\d+_.resnets|decoder_.up_blocks_.\d+_.resnets)")),
    },
    identify=identify,
    diffusers_class="AutoencoderKL",
    pairs=pairs,
    diffusers_config=diffusers_config,
    high_precision={ORIGINAL: (r".",), DIFFUSERS: (r".",)},  # VAEs are not quantized
)
