"""One llama.cpp LLM architecture, as llama.cpp's `convert_hf_to_gguf.py` writes it and ckpt reads it back: the
interface every module of `ckpt.families.llm.archs` fills in.

`LLMArch` holds the facts as data (the HF classes it serves, llama.cpp's architecture name, the module paths of one
decoder layer for reading back, which tensors are transformed how) and the converter's per-class code as methods
that mirror the reference's model classes (`conversion/*.py`): `extra_tensors` is `generate_extra_tensors`,
`tensors` is `modify_tensors`, `parameters` is `set_gguf_parameters`, `vocab` names the `set_vocab` a class uses.
The base class is the reference's `TextModel`; an architecture overrides what its model class overrides, and
calls the base where that one calls `super()`. The HF -> GGUF planner (`ckpt.targets.planners.gguf_llm_out`), the
GGUF -> HF reader (`ckpt.quant.gguf_llm`) and the config checks (`ckpt.families.llm.config_keys`) read only this.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from ckpt.errors import CkptError
from ckpt.families.llm.tensors import HeadRowsPermuted, Shifted, Stacked
from ckpt.io.tensors import RowSlice, Tensor
from ckpt.report import plural

LLAMA_LAYER = ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "post_attention_layernorm")
TOP = ("model.embed_tokens", "model.norm", "lm_head")
SKIPPED = (".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq")  # prepare_tensors: "we don't need these"


@dataclass
class Export:
    """What an architecture's methods read while one HF folder is planned as a GGUF (the reference's model object)."""

    where: str  # the component, for messages about its tensors
    folder: Path
    config_path: Path
    hparams: dict  # as transformers fills them in, text_config merged (`ckpt.families.llm.text.load_hparams`)
    rope: dict  # `ckpt.families.llm.text.rope_parameters`
    n_block: int
    n_head: int
    n_head_kv: int
    n_expert: int
    table: object  # gguf's TensorNameMap for the architecture
    pending: dict = field(default_factory=dict)  # a layer's expert matrices until all have been seen
    notes: list = field(default_factory=list)  # said after the tensors' own notes
    # the HF tensors' shapes by source name (`LLMArch.source_name`), for an architecture's `check` to compare the
    # config with (which layers are which kind, extra blocks such as Qwen3-Next's MTP layers)
    tensor_shapes: dict = field(default_factory=dict)
    # the HF tensors themselves by source name, in the reference's order, for an `extra_tensors` that writes some
    # first (gpt-oss's MXFP4 expert banks, which the reference repacks in generate_extra_tensors)
    tensors: dict = field(default_factory=dict)

    def gguf_name(self, arch: LLMArch, name: str) -> str:
        """`TensorNameMap.get_name` (map_tensor_name): a name gguf's table does not know is an error, as there."""
        gname = self.table.get_name(name, try_suffixes=(".weight", ".bias"))
        if gname is None:
            raise CkptError(f"{self.where}: tensor {name!r} has no llama.cpp name in gguf's {arch.arch} table (a "
                            "variant llama.cpp's converter does not know either); nothing was written")
        return gname


@dataclass
class Readback:
    """What an architecture's reading methods see while a llama.cpp GGUF is read back as the HF model
    (`ckpt.quant.gguf_llm`)."""

    path: Path  # the GGUF, for messages
    header: object  # its GGUFHeader (typed metadata: `header.value(key)`)
    stored: dict  # GGUF name -> stored tensor (`stored_shape`, `type_name`, `quantized`)
    cfg: dict  # config.json as derived so far (the generic keys); `read_config` adds the architecture's
    names: dict  # GGUF name -> HF name, from gguf's table over `LLMArch.layer_modules` (`hf_modules`)
    value: object  # (GGUF name, HF name) -> the stored tensor decoded under that name, q/k rows unpermuted
    notes: list = field(default_factory=list)
    # GGUF tensors `read_config` turned into config.json values (name -> what they became), not read as tensors
    # (Llama 4's `rope_freqs.weight`: its RoPE scaling parameters)
    into_config: dict = field(default_factory=dict)


@dataclass(frozen=True)
class LLMArch:
    """One llama.cpp architecture (the reference's `TextModel` unless a module overrides its methods)."""

    arch: str  # general.architecture (gguf.MODEL_ARCH_NAMES)
    hf_class: str  # config.json architectures[0] written when read back
    model_type: str
    layer_modules: tuple[str, ...]  # module paths under model.layers.N (".weight" / ".bias" added), read back
    rope_permute: bool = False  # llama.cpp permuted q/k rows for its RoPE
    # config.json fields set when a tensor of this GGUF name suffix exists (else False)
    bias_flags: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # config.json `architectures` convert_hf_to_gguf.py writes as this llama.cpp architecture (its model class's
    # `ModelBase.register` names that ckpt supports)
    hf_classes: tuple[str, ...] = ()
    readable: bool = True  # ckpt reads its GGUFs back to HF (`ckpt.quant.gguf_llm`)
    # LlamaModel.set_gguf_parameters: also `{arch}.vocab_size` and `{arch}.rope.dimension_count`
    llama_params: bool = False
    # which config.json keys the architecture's parameters cannot be written without (`config_keys.REQUIRED`)
    params: str = "text"
    # the reference's set_vocab (`ckpt.targets.planners.gguf_vocab.set_vocab`: "llama": LlamaModel's, "qwen2":
    # SentencePiece if there is a tokenizer.model else BPE, "gemma2", "gemma3", "phi3", "glm": theirs; any other
    # name, e.g. "text": TextModel's, BPE from tokenizer.json)
    vocab: str = "qwen2"
    norm_shift: float = 0.0  # added to every `*norm.weight` (Gemma's RMSNorm scales by 1 + weight)
    drop: tuple[str, ...] = ()  # HF tensors the reference leaves out (Gemma 2's lm_head: llama.cpp ties it)
    trim_vocab: bool = False  # Gemma 3: token_embd cut to the tokenizer's size (rows beyond it are padding)
    # mixture of experts: the reference stacks each layer's per-expert matrices into one [experts, rows, cols]
    # tensor. (a substring every expert tensor's name has, its name with {bid} {x} {w}, the projections in the
    # order the stacked tensors are written, the HF name the stacked tensor is mapped from)
    experts: tuple = ()
    # `ckpt.families.llm.config_keys.Shape` rules of the architecture's own: for a tensor they name they replace
    # the generic rules (Qwen3-Next's q_proj holds the query and its gate: twice heads x head_dim rows)
    shape_rules: tuple = ()
    # rows of the query projection per head and head size (read back): 2 where it holds each head's query and then
    # its output gate (Qwen3-Next, Qwen3.5)
    q_rows_per_head: int = 1
    # rows of `ffn_up` per feed_forward_length (read back): 2 where it holds the gate and up projections fused, as the
    # HF model keeps them (Phi-3's gate_up_proj)
    ffn_up_rows: int = 1

    # ------------------------------------------------------------------ the reference's per-class code

    def check(self, x: Export, hf_arch: str) -> None:
        """What the model class refuses of a config before converting anything."""
        if x.n_expert and not self.experts:
            raise CkptError(f"{x.folder}: {hf_arch} with experts (num_experts {x.n_expert}) is not a variant ckpt "
                            "writes; use llama.cpp's convert_hf_to_gguf.py")

    def extra_tensors(self, x: Export) -> list[tuple[str, Tensor]]:
        """generate_extra_tensors: tensors the converter computes (written first)."""
        return []

    def early_parameters(self, w, x: Export) -> None:
        """Keys the reference sets while it prepares the tensors, so before the metadata (Phi-3's attention factor)."""

    def tensors(self, x: Export, name: str, t: Tensor) -> list[tuple[str, Tensor]]:
        """modify_tensors: the GGUF tensors one HF tensor becomes (none while a group is incomplete or when it is left
        out), as `TextModel` / `LlamaModel` do it: experts stacked, norms shifted, the vocabulary trimmed, q/k rows
        permuted for llama.cpp's RoPE."""
        if self.experts and self.experts[0] in name:
            return self.stack_experts(x, name, t)
        if self.norm_shift and name.endswith("norm.weight"):
            t = Shifted(t, self.norm_shift)
        if self.trim_vocab and "embed_tokens.weight" in name and t.shape:
            from ckpt.targets.planners import gguf_vocab

            rows = gguf_vocab.vocab_rows(x.folder, x.hparams)
            if rows < t.shape[0]:
                t = RowSlice(t, 0, rows, name)
        gname = x.gguf_name(self, name)
        if self.rope_permute and name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
            t = permuted(x, name, t, x.n_head if ".q_proj." in name else x.n_head_kv)
        return [(gname, t)]

    def parameters(self, w, x: Export, ftype: int) -> list[str]:
        """set_gguf_parameters: the `add_*` calls on the writer `w`; returns notes."""
        from ckpt.families.llm.text import text_parameters

        return text_parameters(w, self, x.hparams, x.rope, x.n_block, ftype)

    def leaves_out(self, name: str) -> bool:
        """Tensors the reference never writes (prepare_tensors' list, and the architecture's own)."""
        return name.endswith(SKIPPED) or name in self.drop

    def trailing_blocks(self, values: dict) -> int:
        """Blocks the weights may hold after the config's layer count, which the reference converts as further
        blocks (GLM-4.5's NextN/MTP layer as `model.layers.{num_hidden_layers}`); `values`: config.json as written
        or as transformers fills it in. None by default."""
        return 0

    def source_name(self, name: str) -> str | None:
        """filter_tensors: the name the reference converts an HF tensor under, None for one it never reads (a
        vision-language folder's vision tower and projector: `ckpt.families.llm.multimodal`). By default every
        name as it is (a causal LM's folder)."""
        return name

    # ------------------------------------------------------------------ reading back (GGUF -> HF)

    def hf_modules(self, n_blocks: int) -> list[str]:
        """The HF module paths whose GGUF names the reader inverts (".weight" / ".bias" added)."""
        return list(TOP) + [f"model.layers.{i}.{m}" for i in range(n_blocks) for m in self.layer_modules]

    def read_config(self, r: Readback) -> None:
        """config.json keys of the architecture's own, added to `r.cfg` from the metadata and the tensor shapes."""

    def blocks_with(self, r: Readback, suffix: str) -> set[int] | None:
        """The blocks whose `blk.N.<suffix>` a complete GGUF of this architecture holds (checked before anything is
        written); None: every block. An architecture whose layers differ (Llama 4's dense and MoE layers) says
        which."""
        return None

    def in_place(self, gname: str) -> bool:
        """Whether the one HF tensor `read_tensor` makes of this GGUF tensor stands in its place (its values renamed,
        q/k rows unpermuted), so that --keep-format and llama-quantize of the GGUF map a change back to it; False for
        one rebuilt from several GGUF tensors or transposed (gpt-oss's expert banks). True by default."""
        return True

    def read_tensor(self, r: Readback, gname: str) -> list[tuple[str, Tensor]]:
        """The HF tensors one stored GGUF tensor becomes (the inverse of `tensors`): by default its HF name from the
        table, its values as stored (q/k rows unpermuted where llama.cpp permuted them)."""
        hf = r.names.get(gname)
        if hf is None:
            raise CkptError(f"{r.path}: tensor {gname!r} has no Hugging Face name in ckpt's {self.arch} table (a "
                            "variant ckpt does not know); nothing was written")
        return [(hf, r.value(gname, hf))]

    # ------------------------------------------------------------------ shared steps

    def stack_experts(self, x: Export, name: str, t: Tensor) -> list[tuple[str, Tensor]]:
        """One expert matrix into its layer's pending set; the stacked tensors (GGUF name, Stacked) when the set is
        complete, in the reference's order (LlamaModel / Qwen2MoeModel.modify_tensors), else nothing."""
        _, template, projections, merged = self.experts
        bid = next((int(part) for part in name.split(".") if part.isdecimal()), None)
        if bid is None:
            raise CkptError(f"{x.where}: expert tensor {name!r} has no layer number")
        pattern = re.escape(template).replace(r"\{bid\}", str(bid)).replace(r"\{x\}", r"\d+").replace(
            r"\{w\}", "(" + "|".join(projections) + ")")
        if not re.fullmatch(pattern, name):
            raise CkptError(f"{x.where}: expert tensor {name!r} is not one expert's matrix as llama.cpp's converter "
                            f"stacks them ({template.format(bid=bid, x='X', w='/'.join(projections))}); fused expert "
                            "tensors are not written by ckpt (use llama.cpp's convert_hf_to_gguf.py)")
        group = x.pending.setdefault(bid, {})
        group[name] = t
        if len(group) < x.n_expert * len(projections):
            return []
        out = []
        for w in projections:
            names = [template.format(bid=bid, x=i, w=w) for i in range(x.n_expert)]
            missing = next((n for n in names if n not in group), None)
            if missing is not None:
                odd = next(n for n in group if n not in {template.format(bid=bid, x=i, w=p)
                                                         for i in range(x.n_expert) for p in projections})
                raise CkptError(f"{x.where}: expert tensor {odd!r} is not one of the {x.n_expert} experts x "
                                f"{'/'.join(projections)} llama.cpp's converter stacks (no {missing!r})")
            hf = merged.format(bid=bid, w=w)
            gname = x.table.get_name(hf, try_suffixes=(".weight", ".bias"))
            if gname is None:
                raise CkptError(f"{x.where}: stacked experts {hf!r} have no llama.cpp name in gguf's {self.arch} "
                                "table")
            out.append((gname, Stacked(gname, [group.pop(n) for n in names])))
        del x.pending[bid]
        return out

    def finish(self, x: Export) -> None:
        """After the last tensor: a group left incomplete is refused."""
        left = sorted(n for group in x.pending.values() for n in group)
        if left:
            raise CkptError(f"{x.where}: expert tensors of an incomplete set ({plural(len(left), 'tensor')}, e.g. "
                            f"{left[0]!r}; each layer needs {x.n_expert} experts x {len(self.experts[2])} projections)")


def permuted(x: Export, name: str, t: Tensor, heads: int) -> Tensor:
    """`LlamaModel.permute` of a q/k projection's rows (weights and biases), in whole heads."""
    if not t.shape or t.shape[0] % heads or (t.shape[0] // heads) % 2:
        raise CkptError(f"{x.where}: tensor {name!r} has {t.shape[0] if t.shape else 0} rows, not {heads} "
                        "heads of an even size (llama.cpp's RoPE permutes rows in pairs)")
    return HeadRowsPermuted(t, t.shape[0] // heads)
