"""`gpt-oss` (GptOssModel in the reference's conversion/gpt_oss.py): OpenAI's gpt-oss, from a bf16 folder or from
the MXFP4 release as llama.cpp keeps it.

What the reference does, and so ckpt:
- attention sinks: `self_attn.sinks` is converted as `self_attn.sinks.weight` (its filter_tensors), so
  `blk.N.attn_sinks.weight` (1-D: F32); q/k/v/o biases and the router's bias (`ffn_gate_inp.bias`) as they are.
- the experts are fused banks: `gate_up_proj` [experts, hidden, 2 x ff] holds gate and up interleaved by column;
  it is transposed to [experts, 2 x ff, hidden] and split into its even rows (`ffn_gate_exps`) and odd rows
  (`ffn_up_exps`); its bias [experts, 2 x ff] likewise by column. `down_proj` [experts, ff, hidden] is
  transposed to `ffn_down_exps` [experts, hidden, ff]. Each is a streamed view over whole experts.
- MXFP4 banks (`*_blocks` / `*_scales`, which `ckpt.quant.mxfp4` decodes into the same [experts, hidden, ...]
  banks): not dequantized. generate_extra_tensors repacks each bank's bytes into GGML's MXFP4 blocks (the e8m0
  scale byte, then 16 bytes with element j in the low nibble and j + 16 in the high one) and writes them first,
  before every other tensor, in the checkpoint's order (per layer: down, then gate and up). ckpt does the same
  with a `Packed` tensor: its bytes are those repacked blocks (`Mxfp4Repacked`, streamed over experts), written
  as MXFP4 for every `convert_hf_to_gguf.py` outtype; its values are the decoded bank, which a llama-quantize mix
  that gives the tensor another type quantizes (what `llama-quantize --allow-requantize` does with the
  reference's file; without that flag llama-quantize refuses the file). A config with quant_method mxfp4 makes
  general.file_type MOSTLY_MXFP4_MOE for the f32 / f16 / bf16 outtypes, as there.
- parameters: TextModel's (yarn RoPE scaling among them), then `sliding_window` and the experts' feed-forward
  length (= intermediate_size). The vocabulary is `_set_vocab_gpt2` (o200k's byte-level BPE, pre-tokenizer
  `gpt-4o`); the chat template as every model's.

Checked first, where llama.cpp would silently compute another model: llama.cpp's gpt-oss loader fixes the sliding
window to every other layer (even layers sliding) and the SwiGLU constants to alpha 1.702 and limit 7.0, and
requires the attention biases; a config saying otherwise is refused.

Read back (GGUF -> HF): gate and up rows interleaved again and transposed into `gate_up_proj`, down transposed,
biases interleaved; MXFP4 banks dequantized (`ckpt.quant.gguf`); config.json from the metadata, with the
alternation, the SwiGLU constants and yarn's `truncate: false` that llama.cpp fixes (the GGUF records none of them).
"""

from __future__ import annotations

from ckpt.lazy import torch

from ckpt.errors import CkptError
from ckpt.families.llm.arch import TOP, Export, LLMArch, Readback
from ckpt.families.llm.config_keys import Shape, size
from ckpt.families.llm.tensors import Packed
from ckpt.io.tensors import Tensor

EXPERTS = "mlp.experts."
BANKS = ("gate_up_proj", "down_proj")
SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}  # llama.cpp's LLM_FFN_SWIGLU_OAI_MOE constants
GPT_OSS_LAYER = ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "self_attn.sinks", "post_attention_layernorm", "mlp.router")


def layer_types(n_block: int) -> list[str]:
    """llama.cpp's gpt-oss attention pattern (`load_swa_pattern(ml, 2)`): even layers sliding, odd ones full."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_block)]


class ExpertsTransposed(Tensor):
    """An expert bank [experts, K, N] as [experts, N, K] (`data_torch.transpose(-1, -2)`), optionally only its even
    (`parity` 0) or odd (1) rows of N: gpt-oss's fused gate/up split as the reference splits it. Bands are whole
    experts."""

    def __init__(self, base: Tensor, parity: int | None = None, name: str | None = None):
        e, k, n = base.shape
        self.base, self.parity, self.name, self.home = base, parity, name or base.name, base.home
        self.shape = (e, n if parity is None else n // 2, k)
        self.row_align = None if base.row_align is None else 1

    dtype = property(lambda self: self.base.dtype)
    dtype_name = property(lambda self: self.base.dtype_name)

    def natural_source(self):
        return self.base

    @property
    def source_bytes(self):
        return self.base.source_bytes // (1 if self.parity is None else 2)

    def read(self, start, stop, device, scratch=None):
        x = self.base.read(start, stop, device, scratch).transpose(1, 2)
        return (x if self.parity is None else x[:, self.parity::2]).contiguous()


class Interleaved(Tensor):
    """The even (`parity` 0) or odd (1) columns of an expert bias [experts, 2 x ff] (`data_torch[..., ::2]`)."""

    def __init__(self, base: Tensor, parity: int, name: str | None = None):
        self.base, self.parity, self.name, self.home = base, parity, name or base.name, base.home
        self.shape = (base.shape[0], base.shape[1] // 2)
        self.row_align = None if base.row_align is None else 1

    dtype = property(lambda self: self.base.dtype)
    dtype_name = property(lambda self: self.base.dtype_name)

    def natural_source(self):
        return self.base

    def read(self, start, stop, device, scratch=None):
        return self.base.read(start, stop, device, scratch)[:, self.parity::2].contiguous()


class Mxfp4Repacked(Tensor):
    """GGML MXFP4 blocks of a gpt-oss bank, from its `_blocks` [experts, N, G, 16] and `_scales` [experts, N, G]
    (optionally the even or odd rows of N): per block the scale byte, then 16 bytes holding elements j (low nibble)
    and j + 16 (high nibble), where gpt-oss's byte j holds elements 2j (low) and 2j + 1 (high). Only bits move
    (the reference's transform_nibble_layout + repack_mxfp4): uint8 [experts, N, G x 17], whole experts per band."""

    row_align = 1
    dtype_name = "U8"
    dtype = property(lambda self: torch.uint8)  # (a property: planning imports no torch)

    def __init__(self, blocks: Tensor, scales: Tensor, parity: int | None, name: str):
        e, n, g, _ = blocks.shape
        self.blocks, self.scales, self.parity, self.name, self.home = blocks, scales, parity, name, blocks.home
        self.shape = (e, n if parity is None else n // 2, g * 17)

    def read(self, start, stop, device, scratch=None):
        b = self.blocks.read(start, stop, device)
        s = self.scales.read(start, stop, device)
        if self.parity is not None:
            b, s = b[:, self.parity::2], s[:, self.parity::2]
        vals = torch.stack((b & 0x0F, b >> 4), dim=-1).reshape(*b.shape[:-1], 32)
        qs = vals[..., :16] | (vals[..., 16:] << 4)
        return torch.cat((s.unsqueeze(-1), qs), dim=-1).reshape(b.shape[0], b.shape[1], -1).contiguous()


def _decimal(r: Readback, key: str, v) -> float:
    """A float32 metadata value as the decimal it was written from (32.0, 1e-05), checked to be a finite number."""
    from ckpt.lazy import numpy as np

    if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v):
        raise CkptError(f"{r.path}: metadata {key!r} is {str(v)[:40]}, not a finite number")
    return float(str(np.float32(v)))


def _count(r: Readback, key: str, lo: int) -> int:
    v = r.header.value(key)
    if v is None:
        raise CkptError(f"{r.path}: metadata {key!r} is missing (needed for config.json)")
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise CkptError(f"{r.path}: metadata {key!r} is {str(v)[:40]}, not an integer of at least {lo}")
    return v


def _check_banks(r: Readback, experts: int, hidden: int, ff: int) -> None:
    """The router and expert tensors against the expert count and sizes config.json is given (a disagreement would
    be a folder transformers refuses or fills in at random)."""
    want = {"ffn_gate_inp.weight": (experts, hidden), "ffn_gate_inp.bias": (experts,),
            "ffn_gate_exps.weight": (experts, ff, hidden), "ffn_up_exps.weight": (experts, ff, hidden),
            "ffn_down_exps.weight": (experts, hidden, ff), "ffn_gate_exps.bias": (experts, ff),
            "ffn_up_exps.bias": (experts, ff), "ffn_down_exps.bias": (experts, hidden)}
    for gname, t in r.stored.items():
        suffix = gname.split(".", 2)[-1]
        if gname.startswith("blk.") and suffix in want and tuple(t.stored_shape) != want[suffix]:
            raise CkptError(f"{r.path}: tensor {gname} is {list(t.stored_shape)}, not {list(want[suffix])} as the "
                            f"metadata says ({experts} experts, embedding_length {hidden}, feed_forward_length {ff})"
                            "; nothing was written")


def _mxfp4_bank(t) -> bool:
    from ckpt.quant.mxfp4 import Mxfp4Experts

    return isinstance(t, Mxfp4Experts)


class GptOss(LLMArch):
    def check(self, x: Export, hf_arch: str) -> None:
        """What llama.cpp's gpt-oss fixes and the config could say otherwise (the reference writes it unchecked)."""
        h = x.hparams
        if (types := h.get("layer_types")) is not None and list(types) != layer_types(x.n_block):
            want = layer_types(min(x.n_block, 2))
            raise CkptError(f"{x.config_path}: layer_types is {str(types)[:60]}; llama.cpp's gpt-oss alternates "
                            f"{' / '.join(want)} from the first layer (it records no pattern), so that model cannot "
                            "be written")
        for key, want in SWIGLU.items():
            if h.get(key, want) != want:
                raise CkptError(f"{x.config_path}: {key} is {str(h[key])[:20]}; llama.cpp's gpt-oss computes with "
                                f"{want} (it records no value), so that model cannot be written")
        if h.get("attention_bias") is False:
            raise CkptError(f"{x.config_path}: attention_bias is false; llama.cpp's gpt-oss loader requires the q, k, "
                            "v and o biases")

    def extra_tensors(self, x: Export) -> list[tuple[str, Tensor]]:
        """generate_extra_tensors: every MXFP4 bank repacked, first, in the checkpoint's order."""
        out = []
        for name, t in x.tensors.items():
            if not _mxfp4_bank(t):
                continue
            bank = name.rsplit(".", 1)[-1]
            if bank == "down_proj":
                parts = [(name + ".weight", None)]
            elif bank == "gate_up_proj":
                parts = [(name.replace("gate_up_proj", "gate_proj.weight"), 0),
                         (name.replace("gate_up_proj", "up_proj.weight"), 1)]
            else:
                raise CkptError(f"{x.where}: MXFP4 tensor {name!r} is not one of gpt-oss's expert banks "
                                f"({', '.join(BANKS)})")
            for hf, parity in parts:
                gname = x.gguf_name(self, hf)
                values = ExpertsTransposed(t, parity, gname)
                out.append((gname, Packed(values, Mxfp4Repacked(t.base, t.scales, parity, gname), "MXFP4", gname)))
        if out:
            x.notes.append(f"{len(out)} expert tensors from the checkpoint's MXFP4 banks, first, as llama.cpp's "
                           "converter writes them: in MXFP4 as stored (repacked, not requantized), or, where a "
                           "llama-quantize mix gives them another type, quantized from their values (llama-quantize "
                           "--allow-requantize)")
        return out

    def tensors(self, x: Export, name: str, t: Tensor) -> list[tuple[str, Tensor]]:
        """modify_tensors: the banks transposed and split, their biases split (MXFP4 banks: written already); the
        sinks as `sinks.weight` (filter_tensors, done here so that messages name the folder's own tensor)."""
        if name.endswith("self_attn.sinks"):
            return super().tensors(x, name + ".weight", t)
        if EXPERTS not in name:
            return super().tensors(x, name, t)
        if _mxfp4_bank(t):
            return []
        stem, bank = name.rsplit(".", 1)
        if bank == "down_proj":
            self._bank(x, name, t, 3)
            return [(x.gguf_name(self, f"{stem}.down_proj.weight"), ExpertsTransposed(t, None, name))]
        if bank == "down_proj_bias":
            return [(x.gguf_name(self, f"{stem}.down_proj.bias"), t)]
        if bank == "gate_up_proj":
            self._bank(x, name, t, 3)
            return [(x.gguf_name(self, f"{stem}.{w}_proj.weight"), ExpertsTransposed(t, p, f"{stem}.{w}_proj"))
                    for p, w in ((0, "gate"), (1, "up"))]
        if bank == "gate_up_proj_bias":
            self._bank(x, name, t, 2)
            return [(x.gguf_name(self, f"{stem}.{w}_proj.bias"), Interleaved(t, p, f"{stem}.{w}_proj_bias"))
                    for p, w in ((0, "gate"), (1, "up"))]
        return super().tensors(x, name, t)

    def _bank(self, x: Export, name: str, t: Tensor, dims: int) -> None:
        if len(t.shape) != dims or (name.endswith("gate_up_proj") and t.shape[-1] % 2) or \
                (name.endswith("gate_up_proj_bias") and t.shape[-1] % 2):
            raise CkptError(f"{x.where}: tensor {name!r} is {list(t.shape)}, not a gpt-oss expert bank "
                            f"({dims}-D, gate and up interleaved in an even last dim)")

    def parameters(self, w, x: Export, ftype: int) -> list[str]:
        """GptOssModel.set_gguf_parameters; the file type MOSTLY_MXFP4_MOE for an MXFP4 checkpoint written as
        f32 / f16 / bf16 (prepare_metadata)."""
        import gguf

        F = gguf.LlamaFileType
        qc = x.hparams.get("quantization_config")
        mxfp4 = isinstance(qc, dict) and qc.get("quant_method") == "mxfp4"
        if mxfp4 and ftype in (F.ALL_F32, F.MOSTLY_F16, F.MOSTLY_BF16) and any(map(_mxfp4_bank, x.tensors.values())):
            ftype = int(F.MOSTLY_MXFP4_MOE)
        notes = super().parameters(w, x, ftype)
        w.add_sliding_window(x.hparams["sliding_window"])
        w.add_expert_feed_forward_length(x.hparams["intermediate_size"])
        return notes

    def finish(self, x: Export) -> None:
        """Nothing is held back between tensors (the banks are whole tensors)."""

    # ------------------------------------------------------------------ reading back (GGUF -> HF)

    def hf_modules(self, n_blocks: int) -> list[str]:
        return list(TOP) + [f"model.layers.{i}.{m}" for i in range(n_blocks) for m in self.layer_modules] + \
            [f"model.layers.{i}.mlp.experts.{w}_proj" for i in range(n_blocks) for w in ("gate", "up", "down")]

    def read_config(self, r: Readback) -> None:
        import gguf

        K, m = gguf.Keys, r.header
        arch = self.arch
        cfg = r.cfg
        n = cfg["num_hidden_layers"]

        def value(template, default=None):
            return m.value(template.format(arch=arch), default)

        experts = _count(r, K.LLM.EXPERT_COUNT.format(arch=arch), 1)
        used = _count(r, K.LLM.EXPERT_USED_COUNT.format(arch=arch), 1)
        if used > experts:
            raise CkptError(f"{r.path}: metadata {K.LLM.EXPERT_USED_COUNT.format(arch=arch)!r} is {used}, more than "
                            f"the {experts} experts")
        _check_banks(r, experts, cfg["hidden_size"], cfg["intermediate_size"])
        cfg["num_local_experts"], cfg["num_experts_per_tok"] = experts, used
        cfg["sliding_window"] = _count(r, K.Attention.SLIDING_WINDOW.format(arch=arch), 0)
        cfg["layer_types"] = layer_types(n)
        cfg["attention_bias"] = True
        cfg.update(SWIGLU)
        rope = cfg.pop("rope_scaling", None) or {}
        params = {"rope_type": rope.get("rope_type", "default"), "rope_theta": cfg.pop("rope_theta")}
        if params["rope_type"] == "yarn":
            params.update(factor=rope["factor"], truncate=False)
            if (orig := rope.get("original_max_position_embeddings")) is not None:
                params["original_max_position_embeddings"] = orig
            for key, gkey in (("beta_fast", K.Rope.SCALING_YARN_BETA_FAST),
                              ("beta_slow", K.Rope.SCALING_YARN_BETA_SLOW),
                              ("attention_factor", K.Rope.SCALING_YARN_ATTN_FACTOR)):
                if (v := value(gkey)) is not None:
                    params[key] = _decimal(r, gkey.format(arch=arch), v)
        cfg["rope_parameters"] = params
        r.notes[:] = [note for note in r.notes if not note.startswith("config.json rope_scaling")]
        r.notes.append("config.json: layer_types (even layers sliding), swiglu_alpha / swiglu_limit (1.702 / 7.0) and "
                       "yarn's truncate: false are gpt-oss's, which llama.cpp fixes (the GGUF records none of them)")

    def in_place(self, gname: str) -> bool:
        """The expert banks are rebuilt from two GGUF tensors or transposed: none is a stored tensor in its place."""
        return "_exps." not in gname

    def read_tensor(self, r: Readback, gname: str) -> list[tuple[str, Tensor]]:
        if gname.endswith(".attn_sinks.weight") and gname in r.names:  # the HF parameter has no .weight
            hf = r.names[gname].removesuffix(".weight")
            return [(hf, r.value(gname, hf))]
        if "_exps." not in gname or gname not in r.names:
            return super().read_tensor(r, gname)
        stem = r.names[gname].rsplit(".", 2)[0]  # model.layers.N.mlp.experts
        if ".ffn_up_exps." in gname:
            return []  # read with the gate
        if ".ffn_down_exps." in gname:
            if gname.endswith(".bias"):
                return [(f"{stem}.down_proj_bias", r.value(gname, f"{stem}.down_proj_bias"))]
            return [(f"{stem}.down_proj", ExpertsTransposed(r.value(gname, f"{stem}.down_proj")))]
        up = gname.replace(".ffn_gate_exps.", ".ffn_up_exps.")
        if up not in r.stored:
            raise CkptError(f"{r.path}: tensor {up} is missing ({gname} is there); nothing was written")
        gate, upv = r.value(gname, f"{stem}.gate_proj"), r.value(up, f"{stem}.up_proj")
        if gname.endswith(".bias"):
            return [(f"{stem}.gate_up_proj_bias", Zipped(gate, upv, -1, f"{stem}.gate_up_proj_bias"))]
        return [(f"{stem}.gate_up_proj", ExpertsTransposed(Zipped(gate, upv, 1, f"{stem}.gate_up_proj")))]


class Zipped(Tensor):
    """Two tensors [experts, n, ...] interleaved along `dim` (a, b, a, b, ...): gate and up as gpt-oss fuses them."""

    def __init__(self, a: Tensor, b: Tensor, dim: int, name: str):
        if tuple(a.shape) != tuple(b.shape):
            raise CkptError(f"{name}: {a.name} {list(a.shape)} and {b.name} {list(b.shape)} cannot be interleaved")
        self.a, self.b, self.dim, self.name, self.home = a, b, dim % len(a.shape), name, a.home
        self.shape = tuple(d * 2 if i == self.dim else d for i, d in enumerate(a.shape))
        self.row_align = None if a.row_align is None or b.row_align is None else 1

    dtype = property(lambda self: self.a.dtype)
    dtype_name = property(lambda self: self.a.dtype_name)

    def natural_source(self):
        return self.a

    @property
    def source_bytes(self):
        return self.a.source_bytes + self.b.source_bytes

    def read(self, start, stop, device, scratch=None):
        a, b = self.a.read(start, stop, device), self.b.read(start, stop, device)
        return torch.stack((a, b), dim=self.dim + 1).flatten(self.dim, self.dim + 1)


ARCH = GptOss("gpt-oss", "GptOssForCausalLM", "gpt_oss", GPT_OSS_LAYER, hf_classes=("GptOssForCausalLM",),
              params="gpt_oss", vocab="gpt2",
              shape_rules=(
                  Shape("self_attn.sinks", 0, size("heads")),
                  Shape("mlp.router.weight", 0, size("experts")), Shape("mlp.router.weight", 1, size("embd")),
                  Shape("mlp.router.bias", 0, size("experts")),
                  *(Shape(f"mlp.experts.{b}", 0, size("experts")) for b in
                    ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")),
                  Shape("mlp.experts.gate_up_proj", 1, size("embd")),
                  Shape("mlp.experts.gate_up_proj", 2, size("ff", times=2)),
                  Shape("mlp.experts.gate_up_proj_bias", 1, size("ff", times=2)),
                  Shape("mlp.experts.down_proj", 1, size("ff")), Shape("mlp.experts.down_proj", 2, size("embd")),
                  Shape("mlp.experts.down_proj_bias", 1, size("embd"))))
