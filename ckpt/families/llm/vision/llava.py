"""Mistral 3 (Mistral Small 3.1+) and Pixtral-in-Llava vision towers and projectors (LlavaVisionModel in the
reference's conversion/llava.py), Hugging Face folders only: a `pixtral` vision config, the tower's q/k rows permuted
for llama.cpp's RoPE as a text model's are, the [IMG_BREAK] token looked up in the tokenizer and its embedding row
written as `v.token_embd.img_break` (F32, where the embedding comes in the sorted tensor order).

The one place ckpt's file differs from the reference's: that row. LlavaVisionModel extracts it from the language
model's `embed_tokens.weight`, but the reference's MmprojModel.filter_tensors drops every `language_model.` tensor
before the class sees it, so for the Hugging Face layouts (`language_model.model.embed_tokens.weight`, transformers
5's `model.language_model.embed_tokens.weight`) its projector has no `v.token_embd.img_break`, and llama.cpp of the
same tree refuses to load it ("unable to find tensor v.token_embd.img_break": clip.cpp requires it for PIXTRAL).
ckpt lets that one tensor through (`keeps`), so that its projector is the one the class means to write and llama.cpp
loads; every other key and tensor is the reference's."""

from __future__ import annotations

from ckpt.errors import CkptError
from ckpt.families.llm.arch import permuted
from ckpt.families.llm.projector import VisionArch, VisionExport, check_value
from ckpt.io.tensors import Tensor

VISION_PREFIXES = ("multi_modal_projector.", "vision_tower.", "vision_encoder.", "vision_language_adapter.",
                   "patch_merger.", "pre_mm_projector_norm")
BREAK = "[IMG_BREAK]"


class RowOf(Tensor):
    """One row of a matrix as a vector (`embedding[token]`), read from the matrix when written."""

    row_align = None

    def __init__(self, base: Tensor, row: int, name: str):
        self.base, self.row, self.name, self.home = base, row, name, base.home
        self.dtype, self.shape = base.dtype, (base.shape[1],)

    def natural_source(self):
        return self.base

    def read(self, start, stop, device, scratch=None):
        return self.base.read(self.row, self.row + 1, device, scratch).reshape(-1)[start:stop].contiguous()


def token_id(x: VisionExport, token: str) -> int:
    """LlavaVisionModel.get_token_id: tokenizer_config.json's added_tokens_decoder, then tokenizer.json's added
    tokens; both files are read as the reference reads them (the first must exist)."""
    from ckpt.families.llm.tokenizer_files import read_json

    config = read_json(x.folder, "tokenizer_config.json")
    if config is None:
        raise CkptError(f"{x.folder}: no tokenizer_config.json; llama.cpp's converter looks the {token} token up there "
                        "for a Pixtral projector")
    decoder = config.get("added_tokens_decoder") or {}
    if isinstance(decoder, dict):
        for i, data in decoder.items():
            if isinstance(data, dict) and data.get("content") == token and str(i).isdecimal():
                return int(i)
    tokenizer = read_json(x.folder, "tokenizer.json")
    added = tokenizer.get("added_tokens") if tokenizer is not None else None
    for data in added if isinstance(added, list) else ():
        if isinstance(data, dict) and data.get("content") == token and isinstance(data.get("id"), int):
            return data["id"]
    raise CkptError(f"{x.folder}: the tokenizer has no {token} token (tokenizer_config.json, tokenizer.json); a "
                    "Pixtral projector needs its id")


class LlavaVision(VisionArch):
    def prepare(self, x: VisionExport) -> None:
        if x.vision.get("model_type") != "pixtral":
            raise CkptError(f"{x.config_path}: vision_config.model_type is {_show(x.vision.get('model_type'))}; "
                            "llama.cpp's converter writes Llava / Mistral 3 projectors of pixtral vision towers only")
        x.vision["layer_norm_eps"] = x.vision.get("layer_norm_eps", 1e-5)  # hard-coded in modeling_pixtral.py
        x.state["img_break"] = token_id(x, BREAK)

    def keeps(self, x: VisionExport, name: str) -> str | None:
        if x.state["img_break"] > 0 and name.endswith("embed_tokens.weight"):  # module docstring
            return name
        return super().keeps(x, name)

    def tensors(self, x: VisionExport, name: str, t: Tensor) -> list[tuple[str, Tensor]]:
        if name.startswith(VISION_PREFIXES):
            if name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
                heads = check_value(x.vision.get("num_attention_heads"),
                                    f"{x.config_path}: vision_config.num_attention_heads", "int")
                t = permuted(x, name, t, heads)
            return super().tensors(x, name, t)
        row = x.state["img_break"]
        if row > 0 and "embed_tokens.weight" in name:
            import gguf

            if len(t.shape) != 2 or row >= t.shape[0]:
                raise CkptError(f"{x.where}: tensor {name!r} has no row {row} (the {BREAK} token)")
            gname = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.V_TOK_EMBD_IMG_BREAK]
            return super().tensors(x, gname, RowOf(t, row, gname))
        return []  # the language model's other tensors

    def parameters(self, w, x: VisionExport) -> None:
        import gguf

        super().parameters(w, x)
        w.add_clip_projector_type(gguf.VisionProjectorType.PIXTRAL)
        w.add_vision_attention_layernorm_eps(check_value(x.vision["layer_norm_eps"],
                                                         f"{x.config_path}: vision_config.layer_norm_eps", "float"))
        act = x.vision.get("hidden_act")
        if act == "silu":
            w.add_vision_use_silu(True)
        elif act == "gelu":
            w.add_vision_use_gelu(True)
        else:
            raise CkptError(f"{x.config_path}: vision_config.hidden_act is {_show(act)}; llama.cpp's Pixtral "
                            "projector runs silu or gelu")
        if "spatial_merge_size" in x.config:
            w.add_vision_spatial_merge_size(check_value(x.config["spatial_merge_size"],
                                                        f"{x.config_path}: spatial_merge_size", "int"))


def _show(v) -> str:
    from ckpt.families.llm.config_keys import show

    return show(v)


VISION = LlavaVision("LlavaVisionModel", ("LlavaForConditionalGeneration", "Mistral3ForConditionalGeneration"))
