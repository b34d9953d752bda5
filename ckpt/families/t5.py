"""T5 encoders (SD3's and Flux's T5-XXL, `text_encoders.t5xxl.transformer.` in ComfyUI bundles): one
naming, the Hugging Face T5EncoderModel's, so no layout conversion. kohya numbers it te3 (SD3, Flux;
OneTrainer te2 on Flux)."""

from __future__ import annotations

from ckpt.families.spec import Family, Signature, at

FAMILY = Family(
    family_id="t5",
    kind="text_encoder",
    label="T5 encoder",
    layouts={None: Signature(at(r"encoder_.block_.\d+_.layer_.\d+_."))},
    diffusers_class="T5EncoderModel",
    config_classes=(r"T5EncoderModel", r"T5ForConditionalGeneration", r"UMT5EncoderModel"),
    lora_namings=("kohya lora_te2_/lora_te3_", "diffusers text_encoder_2./text_encoder_3.", "PEFT"),
    high_precision={"": (r"(^|\.)shared\.weight$", r"embed_tokens")},
)
