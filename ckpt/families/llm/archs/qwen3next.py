"""`qwen3next` (Qwen3NextModel in the reference's conversion/qwen.py: `_QwenMtpMixin` + `Qwen2MoeModel`): hybrid
layers of gated DeltaNet linear attention (`linear_attn.*`) and gated full attention (`self_attn.*`, q_proj holding
the query and its output gate), every layer a mixture of experts with a gated shared expert. Qwen3.5
(`ckpt.families.llm.archs.qwen35`) is this model with its value heads reordered and an MRoPE default.

What the reference does to the tensors, and so ckpt (each a streamed view):
- `A_log` becomes `-exp(A_log)` (`ssm_a`, in float32 for a BF16 source, as prepare_tensors upcasts it first),
  `dt_bias` is written as `ssm_dt.bias`, the conv1d kernel [channels, 1, kernel] is squeezed to [channels, kernel]
  (kept F32: SSM_CONV1D is on prepare_tensors' always-F32 list);
- every `*norm.weight` + 1 (Qwen3-Next's RMSNorm scales by 1 + weight), except the DeltaNet output norm
  (`linear_attn.norm`, a plain gated RMSNorm);
- `in_proj_qkvz` (rows per key head: q, k, v, z) split into `attn_qkv` (all q heads, all k heads, all v heads)
  and `attn_gate` (z), a regrouping of rows (`RowsGathered`);
- the experts stacked per layer (as Qwen3-MoE), or split from the fused `mlp.experts.gate_up_proj`
  [experts, 2 x ff, hidden] / `down_proj` of newer checkpoints as Qwen2MoeModel splits them;
- MTP: a folder with the multi-token-prediction block (`mtp.*`) gets it as extra layers after the model's own
  (`blk.N.nextn.*`, `{arch}.nextn_predict_layers`, block_count counting them), as the reference writes by
  default; a folder without it (what transformers saves: it has no MTP module) is what
  `convert_hf_to_gguf.py --no-mtp` writes, since the reference itself fails on such a folder without the flag.
Parameters: Qwen2MoeModel's (TextModel's, expert feed-forward lengths), the MTP layer count, then the ssm.* sizes,
which layers are recurrent, the full-attention interval and the partial RoPE dimension count. Vocabulary: TextModel's
(gpt2 BPE).

Read back (GGUF -> HF): each transform undone (`read_tensor`), the config from the metadata (`read_config`); an
MTP layer is left out (transformers has no module for it). A_log comes back as log(-ssm_a), equal within float32
rounding; the norms as stored - 1.
"""

from __future__ import annotations

import re

from ckpt.lazy import torch

from ckpt.errors import CkptError
from ckpt.families.llm.arch import Export, LLMArch, Readback
from ckpt.families.llm.config_keys import Shape, size
from ckpt.families.llm.moe_readback import is_stacked, rope_config, unstacked
from ckpt.families.llm.multimodal import text_model_name
from ckpt.families.llm.tensors import ColumnsGathered, RowsGathered, Shifted
from ckpt.io.tensors import Reshaped, RowConcat, Tensor, read_rows

QWEN3NEXT_LAYER = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                   "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm",
                   "linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba", "linear_attn.conv1d", "linear_attn.A_log",
                   "linear_attn.dt_bias", "linear_attn.norm", "linear_attn.out_proj", "mlp.gate",
                   "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj",
                   "mlp.shared_expert_gate")
EXPERTS = ("experts", "model.layers.{bid}.mlp.experts.{x}.{w}.weight", ("down_proj", "gate_proj", "up_proj"),
           "model.layers.{bid}.mlp.experts.{w}.weight")
# _QwenMtpMixin.filter_tensors: the MTP block's own tensors, as the extra layer's nextn tensors
MTP_NAMES = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm",
             "norm": "shared_head.norm"}
LAYER_KINDS = ("linear_attention", "full_attention")
# the reference's gguf-py names the MTP layer's own tensors for these architectures (MODEL_TENSOR.NEXTN_*); the
# installed gguf may not list them for qwen3next / qwen35 yet, so they are named here as its table names them
NEXTN = {"eh_proj": "NEXTN_EH_PROJ", "embed_tokens": "NEXTN_EMBED_TOKENS", "enorm": "NEXTN_ENORM",
         "hnorm": "NEXTN_HNORM", "shared_head.head": "NEXTN_SHARED_HEAD_HEAD",
         "shared_head.norm": "NEXTN_SHARED_HEAD_NORM"}
_NEXTN = re.compile(r"model\.layers\.(\d+)\.(" + "|".join(re.escape(k) for k in NEXTN) + r")\.(weight|bias)")

_QKV = size("linear_k_heads", "linear_k_dim", times=2) + size("linear_v_heads", "linear_v_dim")
# config.json against the tensors (`config_keys`): the gated query, the DeltaNet projections, the shared expert
# and the fused experts of newer checkpoints
SHAPE_RULES = (
    Shape("self_attn.q_proj.weight", 0, size("heads", "head_dim", times=2)),
    Shape("self_attn.q_proj.weight", 1, size("embd")),
    Shape("linear_attn.in_proj_qkvz.weight", 0, size("linear_k_heads", "linear_k_dim", times=2) +
          size("linear_v_heads", "linear_v_dim", times=2)),
    Shape("linear_attn.in_proj_qkvz.weight", 1, size("embd")),
    Shape("linear_attn.in_proj_ba.weight", 0, size("linear_v_heads", times=2)),
    Shape("linear_attn.in_proj_ba.weight", 1, size("embd")),
    Shape("linear_attn.in_proj_qkv.weight", 0, _QKV), Shape("linear_attn.in_proj_qkv.weight", 1, size("embd")),
    Shape("linear_attn.in_proj_z.weight", 0, size("linear_v_heads", "linear_v_dim")),
    Shape("linear_attn.in_proj_z.weight", 1, size("embd")),
    *(Shape(f"linear_attn.in_proj_{w}.weight", d, size(q)) for w in ("a", "b")
      for d, q in ((0, "linear_v_heads"), (1, "embd"))),
    Shape("linear_attn.conv1d.weight", 0, _QKV), Shape("linear_attn.conv1d.weight", 2, size("conv_kernel")),
    Shape("linear_attn.A_log", 0, size("linear_v_heads")), Shape("linear_attn.dt_bias", 0, size("linear_v_heads")),
    Shape("linear_attn.norm.weight", 0, size("linear_v_dim")),
    Shape("linear_attn.out_proj.weight", 0, size("embd")),
    Shape("linear_attn.out_proj.weight", 1, size("linear_v_heads", "linear_v_dim")),
    *(Shape(f"mlp.shared_expert.{w}_proj.weight", d, size(q)) for w in ("gate", "up")
      for d, q in ((0, "shared_ff"), (1, "embd"))),
    Shape("mlp.shared_expert.down_proj.weight", 0, size("embd")),
    Shape("mlp.shared_expert.down_proj.weight", 1, size("shared_ff")),
    Shape("mlp.shared_expert_gate.weight", 1, size("embd")),
    *(Shape(f"mlp.experts.gate_up_proj{s}", d, q) for s in ("", ".weight")
      for d, q in ((0, size("experts")), (1, size("expert_ff", times=2)), (2, size("embd")))),
    *(Shape(f"mlp.experts.down_proj{s}", d, q) for s in ("", ".weight")
      for d, q in ((0, size("experts")), (1, size("embd")), (2, size("expert_ff")))),
)
_LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.(linear_attn|self_attn)\.")


def _gguf():
    import gguf

    return gguf


class NegExp(Tensor):
    """`-exp(A_log)` (Qwen3NextModel.modify_tensors): computed in float32 for a BF16 source (prepare_tensors upcasts
    it first), else in the source's own dtype, as there."""

    def __init__(self, base: Tensor):
        self.base, self.name, self.home = base, base.name, base.home
        self.shape, self.row_align = tuple(base.shape), base.row_align
        self.dtype = base.dtype if base.dtype in (torch.float16, torch.float32) else torch.float32

    def read(self, start, stop, device, scratch=None):
        return -torch.exp(self.base.read(start, stop, device, scratch).to(self.dtype))


class ExpertRows(Tensor):
    """Rows [lo, hi) of every expert of a fused [experts, rows, cols] tensor (Qwen2MoeModel's `gate_up_proj` split
    into gate and up on dim -2), a few experts per band."""

    def __init__(self, base: Tensor, lo: int, hi: int, name: str):
        self.base, self.lo, self.hi, self.name, self.home = base, lo, hi, name, base.home
        self.shape = (base.shape[0], hi - lo, *base.shape[2:])
        self.row_align = None if base.row_align is None else 1

    dtype = property(lambda self: self.base.dtype)
    dtype_name = property(lambda self: self.base.dtype_name)

    def natural_source(self):
        return self.base

    def read(self, start, stop, device, scratch=None):
        return read_rows(self.base, start, stop, device, scratch)[:, self.lo:self.hi].contiguous()


class NegLog(Tensor):
    """`log(-ssm_a)`: A_log back from the `-exp(A_log)` the converter stored (F32; equal to the original within
    float32 rounding of exp and log)."""

    def __init__(self, base: Tensor, name: str):
        self.base, self.name, self.home = base, name, base.home
        self.shape, self.row_align = tuple(base.shape), base.row_align

    @property
    def dtype(self):
        return self.base.dtype if self.base.dtype in (torch.float16, torch.float32) else torch.float32

    def read(self, start, stop, device, scratch=None):
        return torch.log(-self.base.read(start, stop, device, scratch).to(self.dtype))


class Whole(Tensor):
    """Another tensor's values in another shape, read whole: the shared-expert gate [1, hidden], which a
    llama-quantize file stores as [hidden] (ggml drops trailing dims of 1)."""

    row_align = None

    def __init__(self, base: Tensor, shape: tuple, name: str):
        self.base, self.shape, self.name, self.home = base, tuple(shape), name, base.home

    dtype = property(lambda self: self.base.dtype)
    dtype_name = property(lambda self: self.base.dtype_name)

    def read(self, start, stop, device, scratch=None):
        return read_rows(self.base, 0, self.base.rows, device, scratch).reshape(self.shape)[start:stop]


def _merged(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in runs:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _block(name: str) -> int | None:
    """prepare_tensors' block id: the first number-like part of the name."""
    return next((int(part) for part in name.split(".") if part.isdecimal()), None)


class Qwen3Next(LLMArch):
    v_reorder = False  # Qwen3.5 (_LinearAttentionVReorderBase): value heads from grouped to tiled order
    mrope_default = False  # Qwen3.5 (_Qwen35MRopeMixin): rope.dimension_sections always written

    # ------------------------------------------------------------------ checks before anything is planned

    def source_name(self, name: str) -> str | None:
        """TextModel.filter_tensors (a vision-language folder's text model), then _QwenMtpMixin's `model.mtp.` as
        `mtp.`."""
        name = text_model_name(name)
        if name is not None and name.startswith("model.mtp."):
            name = name.replace("model.", "", 1)
        return name

    def check(self, x: Export, hf_arch: str) -> None:
        super().check(x, hf_arch)
        h = x.hparams
        n_layer = h["num_hidden_layers"]
        nk, nv = h["linear_num_key_heads"], h["linear_num_value_heads"]
        if nv % nk:
            raise CkptError(f"{x.config_path}: linear_num_value_heads is {nv}, not a multiple of linear_num_key_heads "
                            f"({nk}); llama.cpp's converter splits the value heads per key head")
        if h["linear_key_head_dim"] != h["linear_value_head_dim"]:  # the converter writes it all the same
            x.notes.append(f"linear_key_head_dim {h['linear_key_head_dim']} and linear_value_head_dim "
                           f"{h['linear_value_head_dim']} differ: llama.cpp's {self.arch} loader takes both from "
                           "ssm.state_size and will not load this GGUF (written as its converter writes it)")
        self._check_layer_types(x, n_layer)
        n_mtp = self._mtp_layers(x, n_layer)
        if n_mtp:  # _QwenMtpMixin.__init__: the block count and the name table count the MTP layers
            gguf = _gguf()
            enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == self.arch)
            x.n_block = n_layer + n_mtp
            x.table = gguf.get_tensor_name_map(enum, x.n_block)
            x.notes.append(f"{n_mtp} MTP layer{'s' if n_mtp > 1 else ''} (mtp.*) written as block "
                           f"{n_layer}{'+' if n_mtp > 1 else ''} (nextn), as llama.cpp's converter writes them "
                           "without --no-mtp")

    def _check_layer_types(self, x: Export, n_layer: int) -> None:
        """layer_types: one per layer (the reference raises otherwise), each a kind the layer's tensors are."""
        kinds = x.hparams.get("layer_types")
        if kinds is None:
            return
        if not isinstance(kinds, list) or len(kinds) != n_layer:
            got = f"{len(kinds)} entries" if isinstance(kinds, list) else type(kinds).__name__
            raise CkptError(f"{x.config_path}: layer_types has {got}, not one per layer (num_hidden_layers "
                            f"{n_layer})")
        found: dict[int, set[str]] = {}
        for name in x.tensor_shapes:
            if (m := _LAYER_TENSOR.match(name)):
                found.setdefault(int(m.group(1)), set()).add(m.group(2))
        for i, kind in enumerate(kinds):
            if kind not in LAYER_KINDS:
                raise CkptError(f"{x.config_path}: layer_types[{i}] is {str(kind)[:40]!r}, not one of "
                                f"{', '.join(LAYER_KINDS)}")
            want, other = ("linear_attn", "self_attn") if kind == "linear_attention" else ("self_attn", "linear_attn")
            have = found.get(i, set())
            if other in have or want not in have:
                what = f"has {other} tensors" if other in have else f"has no {want} tensors"
                raise CkptError(f"{x.config_path}: layer_types[{i}] is {kind!r} but model.layers.{i} {what}")

    def _mtp_layers(self, x: Export, n_layer: int) -> int:
        """The MTP layers the folder has tensors for (0 for none: what --no-mtp writes), agreeing with
        mtp_num_hidden_layers where config.json states it."""
        mtp = [n for n in x.tensor_shapes if n.startswith("mtp.")]
        if not mtp:
            return 0
        layers = {int(p[2]) for n in mtp if len(p := n.split(".", 3)) == 4 and p[1] == "layers" and p[2].isdecimal()}
        stated = x.hparams.get("mtp_num_hidden_layers") or 0
        if not layers:
            raise CkptError(f"{x.config_path}: the weights have MTP tensors (e.g. {mtp[0]!r}) but no MTP layer "
                            "(mtp.layers.N); llama.cpp's converter needs one (or leave the mtp.* tensors out)")
        if layers != set(range(max(layers) + 1)) or (stated and stated != max(layers) + 1):
            have = f"{len(layers)} MTP layer{'s' if len(layers) > 1 else ''} (mtp.layers.{min(layers)}-{max(layers)})"
            raise CkptError(f"{x.config_path}: mtp_num_hidden_layers is {stated or 'not set'} but the weights hold "
                            f"{have}")
        return stated or max(layers) + 1

    # ------------------------------------------------------------------ modify_tensors

    def tensors(self, x: Export, name: str, t: Tensor) -> list[tuple[str, Tensor]]:
        if name.startswith("mtp."):
            name = self._mtp_name(x, name)
        if "conv1d" in name:  # squeezed first: Qwen3.5's reorder works on the squeezed kernel
            t = _squeezed(x, name, t)
        if self.v_reorder and "linear_attn." in name:
            t = self.v_reordered(x.hparams, name, t)
        if name.endswith(".A_log"):
            t = NegExp(t)
        elif name.endswith(".dt_bias"):
            name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = Shifted(t, 1.0)
        if "in_proj_qkvz.weight" in name:
            return self._split_qkvz(x, name, t)
        if name.endswith(("mlp.experts.down_proj", "mlp.experts.down_proj.weight")):
            return [(x.gguf_name(self, name.removesuffix(".weight") + ".weight"), t)]
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj.weight")):
            return self._split_gate_up(x, name, t)
        if self.experts and self.experts[0] in name:
            return self.stack_experts(x, name, t)
        if (m := _NEXTN.fullmatch(name)) and int(m.group(1)) >= x.hparams["num_hidden_layers"]:
            gguf = _gguf()
            key = getattr(gguf.MODEL_TENSOR, NEXTN[m.group(2)])
            return [(gguf.TENSOR_NAMES[key].format(bid=m.group(1)) + "." + m.group(3), t)]
        return [(x.gguf_name(self, name), t)]

    def _mtp_name(self, x: Export, name: str) -> str:
        """_QwenMtpMixin.filter_tensors: `mtp.layers.I.*` as layer n_layer + I, the block's own tensors as its
        nextn ones."""
        n_layer = x.hparams["num_hidden_layers"]
        parts = name.split(".", 3)
        if len(parts) == 4 and parts[1] == "layers" and parts[2].isdecimal():
            return f"model.layers.{n_layer + int(parts[2])}.{parts[3]}"
        if len(parts) == 3 and parts[1] in MTP_NAMES:
            return f"model.layers.{n_layer}.{MTP_NAMES[parts[1]]}.{parts[2]}"
        return name

    def _split_qkvz(self, x: Export, name: str, t: Tensor) -> list[tuple[str, Tensor]]:
        """Qwen3NextModel.modify_tensors: rows [q, k, v, z] per key head -> [all q, all k, all v] and [all z]."""
        h = x.hparams
        hk, hv = h["linear_key_head_dim"], h["linear_value_head_dim"]
        nk, nv = h["linear_num_key_heads"], h["linear_num_value_heads"]
        vz = nv // nk * hv
        step = 2 * hk + 2 * vz
        q = [(g * step, g * step + hk) for g in range(nk)]
        k = [(g * step + hk, g * step + 2 * hk) for g in range(nk)]
        v = [(g * step + 2 * hk, g * step + 2 * hk + vz) for g in range(nk)]
        z = [(g * step + 2 * hk + vz, (g + 1) * step) for g in range(nk)]
        gguf = _gguf()
        bid = _block(name)
        qkv = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ATTN_QKV].format(bid=bid) + ".weight"
        gate = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ATTN_GATE].format(bid=bid) + ".weight"
        return [(qkv, RowsGathered(t, _merged(q + k + v), qkv)), (gate, RowsGathered(t, _merged(z), gate))]

    def _split_gate_up(self, x: Export, name: str, t: Tensor) -> list[tuple[str, Tensor]]:
        """Qwen2MoeModel.modify_tensors: a fused [experts, 2 x ff, hidden] gate_up_proj as gate (the first ff rows of
        each expert) and up."""
        if len(t.shape) < 3 or t.shape[-2] % 2:
            raise CkptError(f"{x.where}: tensor {name!r} is {list(t.shape)}, not [experts, 2 x ff, hidden] "
                            "(llama.cpp's converter splits it in gate and up)")
        ff = t.shape[-2] // 2
        base = name.removesuffix(".weight").removesuffix(".gate_up_proj")
        out = []
        for w, lo in (("gate_proj", 0), ("up_proj", ff)):
            gname = x.gguf_name(self, f"{base}.{w}.weight")
            out.append((gname, ExpertRows(t, lo, lo + ff, gname)))
        return out

    def v_reordered(self, h: dict, name: str, t: Tensor, back: bool = False) -> Tensor:
        """_LinearAttentionVReorderBase.modify_tensors: where there are more value heads than key heads, the value
        heads (grouped by key head in HF) in the tiled order ggml broadcasts in, along the dim each tensor holds
        them on (the rows; out_proj's columns). `back`: the inverse, tiled to grouped (reading a GGUF back);
        `name` is the HF name either way, `h` the config's linear_* sizes."""
        nk, nv = h["linear_num_key_heads"], h["linear_num_value_heads"]
        if nk == nv:
            return t
        hk, hv, r = h["linear_key_head_dim"], h["linear_value_head_dim"], nv // nk

        def heads(offset: int, dim: int) -> list[tuple[int, int]]:
            order = [(g, j) for g in range(nk) for j in range(r)] if back else \
                [(g, j) for j in range(r) for g in range(nk)]
            at = [(j * nk + g) if back else (g * r + j) for g, j in order]
            return [(offset + i * dim, offset + (i + 1) * dim) for i in at]

        if ".in_proj_qkv." in name or ".conv1d" in name:
            runs = [(0, 2 * nk * hk)] + heads(2 * nk * hk, hv)
        elif ".in_proj_z." in name:
            runs = heads(0, hv)
        elif ".in_proj_b." in name or ".in_proj_a." in name or ".A_log" in name or ".dt_bias" in name:
            runs = heads(0, 1)
        elif ".out_proj." in name:
            return ColumnsGathered(t, [c for a, b in heads(0, hv) for c in range(a, b)])
        else:
            return t
        return RowsGathered(t, _merged(runs))

    # ------------------------------------------------------------------ set_gguf_parameters

    def parameters(self, w, x: Export, ftype: int) -> list[str]:
        """Qwen3NextModel.set_gguf_parameters: Qwen2MoeModel's (TextModel's, the expert feed-forward lengths),
        _QwenMtpMixin's MTP layer count, then the DeltaNet sizes, the recurrent layers, the full-attention
        interval and the rotated dimensions; Qwen3.5's MRoPE sections where none are configured."""
        notes = super().parameters(w, x, ftype)
        h = x.hparams
        if (n := h.get("moe_intermediate_size")) is not None:
            w.add_expert_feed_forward_length(n)
        if (n := h.get("shared_expert_intermediate_size")) is not None:
            w.add_expert_shared_feed_forward_length(n)
        n_layer = h["num_hidden_layers"]
        if (n_mtp := x.n_block - n_layer) > 0:
            w.add_nextn_predict_layers(n_mtp)
        w.add_ssm_conv_kernel(h["linear_conv_kernel_dim"])
        w.add_ssm_state_size(h["linear_key_head_dim"])
        w.add_ssm_group_count(h["linear_num_key_heads"])
        w.add_ssm_time_step_rank(h["linear_num_value_heads"])
        w.add_ssm_inner_size(h["linear_value_head_dim"] * h["linear_num_value_heads"])
        if (kinds := h.get("layer_types")) is not None:
            recurrent = [k == "linear_attention" for k in kinds] + [False] * (x.n_block - n_layer)
            # gguf.Keys.Attention.RECURRENT_LAYERS (add_recurrent_layers) of the reference's gguf-py; the
            # installed gguf may predate it
            w.add_array(f"{self.arch}.attention.recurrent_layers", recurrent)
        w.add_full_attention_interval(h.get("full_attention_interval", 4))
        rope_dim = h.get("head_dim")
        if rope_dim is None:
            rope_dim = h["hidden_size"] // h["num_attention_heads"]
        w.add_rope_dimension_count(int(rope_dim * x.rope.get("partial_rotary_factor", 0.25)))
        if self.mrope_default and "mrope_section" not in x.rope:
            w.add_rope_dimension_sections([11, 11, 10, 0])
        return notes


    # ------------------------------------------------------------------ reading back (GGUF -> HF)

    def read_config(self, r: Readback) -> None:
        """The config class's keys from the metadata: the model's own layers (block_count less the MTP layers,
        which transformers has no module for and which are left out), the DeltaNet sizes, the layer kinds
        (`attention.recurrent_layers`, else llama.cpp's full-attention interval), the experts, the partial
        rotary factor of rope.dimension_count (and Qwen3.5's MRoPE sections); each checked against the tensors
        that show it."""
        import gguf

        from ckpt.quant.gguf_llm import Meta

        K = gguf.Keys
        m, cfg = Meta(r.header, self.arch), r.cfg
        n_blocks, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
        nextn = m.integer(K.LLM.NEXTN_PREDICT_LAYERS, 0, lo=0)
        if nextn >= n_blocks:
            raise m.bad(m.key(K.LLM.NEXTN_PREDICT_LAYERS), nextn, f"not fewer than the {n_blocks} blocks")
        n_layer = n_blocks - nextn
        nk, nv = m.integer(K.SSM.GROUP_COUNT), m.integer(K.SSM.TIME_STEP_RANK)
        hk, inner, kernel = m.integer(K.SSM.STATE_SIZE), m.integer(K.SSM.INNER_SIZE), m.integer(K.SSM.CONV_KERNEL)
        if nv % nk:
            raise m.bad(m.key(K.SSM.TIME_STEP_RANK), nv, f"not a multiple of {m.key(K.SSM.GROUP_COUNT)} ({nk})")
        if inner % nv:
            raise m.bad(m.key(K.SSM.INNER_SIZE), inner, f"not {nv} value heads of one size")
        hv = inner // nv
        kinds = self._layer_kinds(m, r, n_blocks, n_layer)
        cfg.update(num_hidden_layers=n_layer, layer_types=kinds, linear_conv_kernel_dim=kernel,
                   linear_key_head_dim=hk, linear_value_head_dim=hv, linear_num_key_heads=nk,
                   linear_num_value_heads=nv)
        qkv = 2 * nk * hk + nv * hv
        want = {"attn_qkv": ((qkv, hidden), K.SSM.STATE_SIZE), "attn_gate": ((inner, hidden), K.SSM.INNER_SIZE),
                "ssm_a": ((nv,), K.SSM.TIME_STEP_RANK), "ssm_dt": ((nv,), K.SSM.TIME_STEP_RANK),
                "ssm_conv1d": ((qkv, kernel), K.SSM.STATE_SIZE), "ssm_norm": ((hv,), K.SSM.INNER_SIZE),
                "ssm_out": ((hidden, inner), K.SSM.INNER_SIZE), "ssm_ba": ((2 * nv, hidden), K.SSM.TIME_STEP_RANK),
                "ssm_alpha": ((nv, hidden), K.SSM.TIME_STEP_RANK), "ssm_beta": ((nv, hidden), K.SSM.TIME_STEP_RANK)}
        if self.experts:
            n_expert, used = m.integer(K.LLM.EXPERT_COUNT), m.integer(K.LLM.EXPERT_USED_COUNT)
            if used > n_expert:
                raise m.bad(m.key(K.LLM.EXPERT_USED_COUNT), used, f"more than the {n_expert} experts")
            ff, shared = m.integer(K.LLM.EXPERT_FEED_FORWARD_LENGTH), m.integer(K.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH)
            ffk, sk = K.LLM.EXPERT_FEED_FORWARD_LENGTH, K.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH
            want.update({"ffn_gate_exps": ((n_expert, ff, hidden), ffk), "ffn_up_exps": ((n_expert, ff, hidden), ffk),
                         "ffn_down_exps": ((n_expert, hidden, ff), ffk), "ffn_gate_inp": ((n_expert, hidden),
                                                                                           K.LLM.EXPERT_COUNT),
                         "ffn_gate_shexp": ((shared, hidden), sk), "ffn_up_shexp": ((shared, hidden), sk),
                         "ffn_down_shexp": ((hidden, shared), sk)})
            cfg.update(num_experts=n_expert, num_experts_per_tok=used, moe_intermediate_size=ff,
                       shared_expert_intermediate_size=shared, norm_topk_prob=True)  # llama.cpp normalises them
        for name, t in r.stored.items():
            parts = name.split(".")
            if len(parts) < 3 or parts[0] != "blk" or int(parts[1]) >= n_layer or parts[2] not in want:
                continue
            shape, key = want[parts[2]]
            if parts[2] == "ssm_conv1d" and tuple(t.stored_shape[:1]) == shape[:1]:
                key = K.SSM.CONV_KERNEL  # the rows are right: the kernel size is not
            if parts[2].endswith("_exps") and tuple(t.stored_shape[:1]) != shape[:1]:
                key = K.LLM.EXPERT_COUNT  # the experts' count differs, not their size
            if tuple(t.stored_shape) != shape:
                raise m.bad(m.key(key), m.integer(key), f"but {name} is {list(t.stored_shape)}, not {list(shape)}")
        rope = rope_config(m, cfg, cfg["head_dim"])
        sections = r.header.value(m.key(K.Rope.DIMENSION_SECTIONS))
        if self.mrope_default and isinstance(sections, list) and len(sections) >= 3:
            rope["mrope_section"] = sections[:3]
        cfg["rope_parameters"] = rope
        left = [n for n in r.stored if n.startswith("blk.") and int(n.split(".")[1]) >= n_layer]
        for n in left:
            r.into_config[n] = "left out: an MTP layer, which transformers' model has no module for"
        if left:
            r.notes.append(f"{nextn} MTP layer{'s' if nextn > 1 else ''} (blocks {n_layer}+, {len(left)} tensors) "
                           "left out: transformers' model has no multi-token-prediction module")

    def _layer_kinds(self, m, r: Readback, n_blocks: int, n_layer: int) -> list[str]:
        """layer_types from `attention.recurrent_layers` (one per block, the MTP blocks full attention), else
        llama.cpp's default from the full-attention interval."""
        import gguf

        from ckpt.families.llm.config_keys import show

        key = m.key("{arch}.attention.recurrent_layers")
        flags = r.header.value(key)
        if flags is None:
            interval = m.integer(gguf.Keys.LLM.FULL_ATTENTION_INTERVAL, 4)
            flags = [i < n_layer and (i + 1) % interval != 0 for i in range(n_blocks)]
        if not isinstance(flags, list) or any(not isinstance(v, bool) for v in flags):
            raise m.bad(key, show(flags), f"not {n_blocks} true/false values (one per block)")
        if len(flags) != n_blocks:
            raise m.bad(m.key(gguf.Keys.LLM.BLOCK_COUNT), n_blocks, f"but {key} has {len(flags)} values (one per "
                                                                     "block)")
        if any(flags[n_layer:]):
            raise m.bad(key, show(flags), "but the MTP layers at its end are full-attention layers")
        for i, linear in enumerate(flags[:n_layer]):
            other = f"blk.{i}.attn_q.weight" if linear else f"blk.{i}.attn_qkv.weight"
            if other in r.stored:
                raise m.bad(key, show(flags), f"but block {i} is a {'full' if linear else 'linear'}-attention layer "
                                              f"({other})")
        return ["linear_attention" if v else "full_attention" for v in flags[:n_layer]]

    def blocks_with(self, r: Readback, suffix: str) -> set[int] | None:
        """DeltaNet tensors in the linear-attention layers, attention ones in the others; the MTP layers' (left
        out) as the file has them; norms and MLP everywhere."""
        kinds = r.cfg["layer_types"]
        n_layer = len(kinds)
        nextn = r.header.value(f"{self.arch}.nextn_predict_layers", 0)  # checked by read_config
        every = set(range(n_layer, n_layer + nextn))  # the MTP layers: nextn.* in each
        kind = suffix.split(".")[0]
        if kind == "nextn":
            return every
        mtp = {b for b in every if f"blk.{b}.{suffix}" in r.stored}
        if kind.startswith("ssm_") or kind in ("attn_qkv", "attn_gate"):
            return {i for i in range(n_layer) if kinds[i] == "linear_attention"} | mtp
        if kind in ("attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm"):
            return {i for i in range(n_layer) if kinds[i] == "full_attention"} | mtp
        return set(range(n_layer)) | mtp

    def in_place(self, gname: str) -> bool:
        """Only the tensors read back as stored (renamed): a norm (shifted), a stacked expert bank, a DeltaNet
        tensor llama.cpp transformed, split or reordered is rebuilt, not in its place."""
        kind = gname.split(".")[2] if gname.startswith("blk.") else gname
        if is_stacked(gname) or gname.endswith("norm.weight") and kind != "ssm_norm":
            return False
        if kind in ("ssm_a", "ssm_dt", "ssm_conv1d", "attn_qkv", "attn_gate", "ffn_gate_inp_shexp"):
            return False
        return not (self.v_reorder and kind in ("ssm_alpha", "ssm_beta", "ssm_out"))

    def read_tensor(self, r: Readback, gname: str) -> list[tuple[str, Tensor]]:
        """Each `tensors` transform undone: norms - 1 (not the DeltaNet's), A_log = log(-ssm_a), dt_bias, the
        conv1d kernel's [channels, 1, kernel], in_proj_qkvz regrouped from attn_qkv and attn_gate (Qwen3-Next) or
        Qwen3.5's value heads back in grouped order, one tensor per expert."""
        from ckpt.quant.gguf_llm import NormUnshifted

        parts = gname.split(".")
        if parts[0] != "blk":
            if gname.endswith("norm.weight"):
                hf = r.names[gname]
                return [(hf, NormUnshifted(r.value(gname, hf), 1.0, hf))]
            return super().read_tensor(r, gname)
        bid, kind = parts[1], parts[2]
        layer = f"model.layers.{bid}"
        if is_stacked(gname):
            return unstacked(r, gname, f"{layer}.mlp.experts.{{x}}.{kind.split('_')[1]}_proj.weight")
        lin = f"{layer}.linear_attn"
        if kind == "ssm_a":
            return [(f"{lin}.A_log", self._back(r, f"{lin}.A_log", NegLog(r.value(gname, f"{lin}.A_log"),
                                                                          f"{lin}.A_log")))]
        if kind == "ssm_dt":
            return [(f"{lin}.dt_bias", self._back(r, f"{lin}.dt_bias", r.value(gname, f"{lin}.dt_bias")))]
        if kind == "ssm_conv1d":
            hf = f"{lin}.conv1d.weight"
            t = self._back(r, hf, r.value(gname, hf))
            return [(hf, Reshaped(t, (t.shape[0], 1, *t.shape[1:]), hf))]
        if kind == "ffn_gate_inp_shexp":
            hf = f"{layer}.mlp.shared_expert_gate.weight"
            return [(hf, Whole(r.value(gname, hf), (1, r.cfg["hidden_size"]), hf))]
        if not self.v_reorder and kind in ("attn_qkv", "attn_gate"):
            return self._qkvz(r, gname, lin) if kind == "attn_gate" else []
        hf = {"attn_qkv": f"{lin}.in_proj_qkv.weight", "attn_gate": f"{lin}.in_proj_z.weight",
              "ssm_alpha": f"{lin}.in_proj_a.weight", "ssm_beta": f"{lin}.in_proj_b.weight",
              "ssm_ba": f"{lin}.in_proj_ba.weight", "ssm_norm": f"{lin}.norm.weight",
              "ssm_out": f"{lin}.out_proj.weight"}.get(kind)
        if hf is not None:
            return [(hf, self._back(r, hf, r.value(gname, hf)))]
        if gname.endswith("norm.weight"):
            hf = r.names[gname]
            return [(hf, NormUnshifted(r.value(gname, hf), 1.0, hf))]
        return super().read_tensor(r, gname)

    def _back(self, r: Readback, hf: str, t: Tensor) -> Tensor:
        """Qwen3.5's value heads back in HF's grouped order."""
        return self.v_reordered(r.cfg, hf, t, back=True) if self.v_reorder else t

    def _qkvz(self, r: Readback, gname: str, lin: str) -> list[tuple[str, Tensor]]:
        """in_proj_qkvz from attn_qkv (all q, all k, all v heads) and attn_gate (all z): rows [q, k, v, z] per key
        head again."""
        h = r.cfg
        hk, hv = h["linear_key_head_dim"], h["linear_value_head_dim"]
        nk, nv = h["linear_num_key_heads"], h["linear_num_value_heads"]
        vz = nv // nk * hv
        hf = f"{lin}.in_proj_qkvz.weight"
        qkv_name = gname.replace(".attn_gate.", ".attn_qkv.")
        if qkv_name not in r.stored:
            return []  # refused by the completeness check, naming it
        qkv, z = r.value(qkv_name, hf), r.value(gname, hf)
        both = RowConcat(hf, [qkv, z])
        at = 2 * nk * hk + nk * vz  # where z starts
        runs = [run for g in range(nk) for run in ((g * hk, (g + 1) * hk), (nk * hk + g * hk, nk * hk + (g + 1) * hk),
                                                     (2 * nk * hk + g * vz, 2 * nk * hk + (g + 1) * vz),
                                                     (at + g * vz, at + (g + 1) * vz))]
        return [(hf, RowsGathered(both, _merged(runs), hf))]


def _squeezed(x: Export, name: str, t: Tensor) -> Tensor:
    """`data_torch.squeeze()` of the conv1d kernel: [channels, 1, kernel] -> [channels, kernel]."""
    shape = tuple(d for d in t.shape if d != 1)
    if shape == tuple(t.shape):
        return t
    if not shape or not t.shape or shape[0] != t.shape[0]:
        raise CkptError(f"{x.where}: tensor {name!r} is {list(t.shape)}, not a [channels, 1, kernel] convolution")
    return Reshaped(t, shape, t.name)


ARCH = Qwen3Next("qwen3next", "Qwen3NextForCausalLM", "qwen3_next", QWEN3NEXT_LAYER,
                 hf_classes=("Qwen3NextForCausalLM",), params="qwen3next", vocab="gpt2", experts=EXPERTS,
                 shape_rules=SHAPE_RULES, q_rows_per_head=2)
