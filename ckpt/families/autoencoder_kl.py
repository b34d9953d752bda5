"""Image VAEs (AutoencoderKL: SD1/SD2/SDXL 4-channel latents, SD3/Flux.1 16-channel): LDM names
(`encoder.down.0.block.0`, the "original" layout, `first_stage_model.` in single files, `vae.` in
ComfyUI bundles) <-> diffusers AutoencoderKL (`encoder.down_blocks.0.resnets.0`)."""

from __future__ import annotations

from ckpt.families.spec import DIFFUSERS, ORIGINAL, Family, Signature, at, dim


def identify(keys, shapes, layout):
    z = dim(shapes, keys, at(r"encoder_.conv_out\.weight$"), 0)
    latents = f", {z // 2}-channel latents" if z else ""
    return "autoencoder_kl", f"VAE ({'diffusers AutoencoderKL' if layout == DIFFUSERS else 'LDM'}{latents})"


FAMILY = Family(
    family_id="autoencoder_kl",
    label="VAE (AutoencoderKL)",
    layouts={
        ORIGINAL: Signature(at(r"(encoder_.down_.\d+_.block|decoder_.up_.\d+_.block)_.")),
        DIFFUSERS: Signature(at(r"(encoder_.down_blocks_.\d+_.resnets|decoder_.up_blocks_.\d+_.resnets)")),
    },
    identify=identify,
    diffusers_class="AutoencoderKL",
    high_precision={ORIGINAL: (r".",), DIFFUSERS: (r".",)},  # VAEs are not quantized
)
