"""One vision projector (llama.cpp's `mmproj` GGUF, architecture `clip`) as `convert_hf_to_gguf.py --mmproj` writes
it: the interface every module of `ckpt.families.llm.vision` fills in.

The reference's `MmprojModel` (conversion/base.py) and its per-model subclasses are mirrored as `VisionArch` methods:
`prepare` is the subclass's `__init__` (the vision config completed or renamed), `keeps` is `filter_tensors`,
`tensors` is `modify_tensors`, `force_type` is `tensor_force_quant`, `parameters` is `set_gguf_parameters`. The base
class is `MmprojModel` itself; a module overrides what its class overrides and calls the base where that one calls
`super()`. The planner (`ckpt.targets.planners.gguf_mmproj_out`) reads only this. A vision module is found by
`ckpt.families.llm.projectors` (`VISION = ...`), as the text architectures are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ckpt.errors import CkptError
from ckpt.io.tensors import Tensor

# MmprojModel.n_block_keys: where a vision config says its layer count
BLOCK_KEYS = ("n_layers", "num_hidden_layers", "n_layer", "num_layers", "depth", "layers", "encoder_layers",
              "vt_num_hidden_layers")


def _show(value) -> str:
    from ckpt.families.llm.config_keys import show

    return show(value)


@dataclass
class VisionExport:
    """What a vision module's methods read while one HF VLM folder is planned as its projector GGUF (the reference's
    MmprojModel object)."""

    where: str  # the component, for messages about its tensors
    folder: Path
    config_path: Path
    config: dict  # global_config: the whole config as transformers fills it in
    vision: dict  # hparams_vision: a copy of `vision_config` the module completes (`VisionArch.prepare`)
    preprocessor: dict  # preprocessor_config.json and processor_config.json merged, as MmprojModel reads them
    n_embd_text: int  # the language model's hidden size (clip.vision.projection_dim)
    n_block: int  # the vision layer count gguf's name table is built for
    table: object  # gguf's TensorNameMap for MODEL_ARCH.MMPROJ
    ftype: str  # gguf.LlamaFileType member name of the output (MOSTLY_F16, ...)
    notes: list = field(default_factory=list)
    state: dict = field(default_factory=dict)  # what a model class's __init__ keeps for later (Qwen3-VL's DeepStack)

    def gguf_name(self, name: str) -> str:
        """`map_tensor_name`: a name gguf's table does not know is an error, as there."""
        gname = self.table.get_name(name, try_suffixes=(".weight", ".bias"))
        if gname is None:
            raise CkptError(f"{self.where}: tensor {name!r} has no llama.cpp name in gguf's mmproj table (for "
                            f"{self.n_block} vision layers, as config.json's vision_config says); nothing was written")
        return gname

    def vparam(self, keys, optional: bool = False, what: str = "int"):
        """`find_vparam`: the first of `keys` in the vision config, checked to be what the GGUF key holds ("int": a
        positive integer, "float": a number); a missing one is refused (None where `optional`)."""
        key = next((k for k in keys if k in self.vision), None)
        if key is None:
            if optional:
                return None
            raise CkptError(f"{self.config_path}: vision_config has none of {', '.join(keys)} (llama.cpp's "
                            "converter needs it for the projector)")
        return check_value(self.vision[key], f"{self.config_path}: vision_config.{key}", what)

    def pparam(self, key: str, what: str = "floats3"):
        """A preprocessor_config.json value the projector needs (image_mean, image_std), checked."""
        if key not in self.preprocessor:
            raise CkptError(f"{self.folder}: no {key} in preprocessor_config.json / processor_config.json (llama.cpp's "
                            "converter writes the image normalization into the projector)")
        return check_value(self.preprocessor[key], f"{self.folder / 'preprocessor_config.json'}: {key}", what)


def check_value(v, label: str, what: str):
    """`v` if it is what a GGUF key of that kind holds: "int" (a positive integer), "float" (a finite number),
    "floats3" (a list of three numbers: an RGB mean or deviation), "bool"; else one line."""
    import math

    def number(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    ok = {"int": lambda: isinstance(v, int) and not isinstance(v, bool) and 0 < v < 2**31,
          "float": lambda: number(v),
          "floats3": lambda: isinstance(v, list) and len(v) == 3 and all(number(x) for x in v),
          "bool": lambda: isinstance(v, bool)}[what]()
    if not ok:
        want = {"int": "a positive integer", "float": "a number", "floats3": "a list of 3 numbers",
                "bool": "true or false"}[what]
        raise CkptError(f"{label} is {_show(v)}, not {want}")
    return v


@dataclass(frozen=True)
class VisionArch:
    """One model class of the reference's `--mmproj` (MmprojModel unless a module overrides its methods)."""

    name: str  # the reference's class, for messages ("Gemma3VisionModel")
    hf_classes: tuple[str, ...]  # config.json `architectures` it is registered for

    def prepare(self, x: VisionExport) -> None:
        """The subclass's __init__: the vision config completed (defaults, renamed keys) before anything is read."""

    def keeps(self, x: VisionExport, name: str) -> str | None:
        """filter_tensors: the name the converter goes on with, or None for a tensor it never reads (MmprojModel:
        the language model's)."""
        if "language_model." in name:
            return None
        if name.endswith("e_score_correction_bias"):  # ModelBase.filter_tensors
            name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        return name

    def tensors(self, x: VisionExport, name: str, t: Tensor) -> list[tuple[str, Tensor]]:
        """modify_tensors: the GGUF tensors one (kept) HF tensor becomes."""
        return [(x.gguf_name(name), t)]

    def force_type(self, x: VisionExport, name: str, gname: str) -> str | None:
        """tensor_force_quant: a GGML type name the tensor is written in whatever the outtype (None: the rules)."""
        if ".patch_embd.weight" in gname or ".patch_merger.weight" in gname:
            return "F16" if x.ftype == "MOSTLY_F16" else "F32"
        return None

    def parameters(self, w, x: VisionExport) -> None:
        """MmprojModel.set_gguf_parameters: the `add_*` calls on the writer `w` (a vision encoder)."""
        import gguf

        w.add_file_type(int(gguf.LlamaFileType[x.ftype]))
        w.add_clip_has_vision_encoder(True)
        w.add_vision_projection_dim(x.n_embd_text)
        w.add_vision_image_size(x.vparam(["image_size"]))
        w.add_vision_patch_size(x.vparam(["patch_size"]))
        w.add_vision_embedding_length(x.vparam(["hidden_size", "width", "vt_hidden_size"]))
        w.add_vision_feed_forward_length(x.vparam(["intermediate_size", "vt_intermediate_size"]))
        w.add_vision_block_count(x.vparam(BLOCK_KEYS))
        w.add_vision_head_count(x.vparam(["num_attention_heads", "num_heads", "heads", "vt_num_attention_heads"]))
        w.add_vision_image_mean(x.pparam("image_mean"))
        w.add_vision_image_std(x.pparam("image_std"))

    def check(self, x: VisionExport, sources: list[tuple[str, Tensor]]) -> None:
        """After the tensors are planned: the vision config agrees with them where llama.cpp would read past them
        (its layer count, its width), in one line naming both."""
        blocks = sorted({int(g.split(".")[2]) for g, _ in sources if g.startswith("v.blk.")})
        if blocks != list(range(x.n_block)):
            raise CkptError(f"{x.config_path}: vision_config says {x.n_block} vision layers but the tensors have "
                            f"{len(blocks)} (v.blk.{blocks[0] if blocks else 0}..{blocks[-1] if blocks else ''}); "
                            "nothing was written")
        width = x.vparam(["hidden_size", "width", "vt_hidden_size"])
        patch = next((t for g, t in sources if g == "v.patch_embd.weight"), None)
        if patch is not None and patch.shape and patch.shape[0] != width:
            raise CkptError(f"{x.config_path}: vision_config's hidden size is {width} but {patch.name} has "
                            f"{patch.shape[0]} output channels; nothing was written")
