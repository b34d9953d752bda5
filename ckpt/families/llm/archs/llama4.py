"""`llama4` (Llama4Model in the reference's conversion/llama.py): Llama 4's language model, from a
`Llama4ForConditionalGeneration` folder (its text part: the vision tower and the projector are the `--mmproj` file,
left out here as `ckpt.families.llm.multimodal` leaves them) or a text-only `Llama4ForCausalLM`.

Llama4Model is a LlamaModel without the q/k row permutation (Llama 4's RoPE rotates adjacent pairs, as llama.cpp's
does): Llama 3 RoPE factors as `rope_freqs.weight`, LlamaModel's parameters with `intermediate_size_mlp` (the dense
layers') as the feed-forward length, then its own keys: the MoE layer interleave step, the experts' feed-forward
length (`intermediate_size`) and, where every layer is full attention, a sliding window of 0. Its experts are
fused in the checkpoint: `experts.gate_up_proj` [experts, hidden, 2 x ff] becomes `ffn_gate_exps` and
`ffn_up_exps` (each half transposed), `experts.down_proj` [experts, ff, hidden] becomes `ffn_down_exps`
transposed (`ExpertColumnsTransposed`, read expert by expert). The shared expert, the router and the dense layers'
MLP keep their shapes. Chunked attention, the NoPE layers and the attention temperature are not in the GGUF:
llama.cpp fixes them for the architecture (chunks of 8192, every 4th layer without RoPE), so a config that sets
them otherwise is written with a note.

Read back as `Llama4ForCausalLM` (the text model): the fused expert tensors joined again (`ExpertsFused`), the
Llama 3 RoPE parameters recovered from `rope_freqs.weight`."""

from __future__ import annotations

import math

from ckpt.lazy import torch

from ckpt.errors import CkptError
from ckpt.families.llm.arch import Export, Readback
from ckpt.families.llm.config_keys import Shape, show, size
from ckpt.families.llm.archs.llama import Llama, llama3_rope_factors
from ckpt.families.llm.multimodal import text_model_name
from ckpt.io.tensors import Tensor, read_rows
from ckpt.io.wrapper import Wrapper

LLAMA4_LAYER = ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "post_attention_layernorm")
DENSE = ("feed_forward.gate_proj", "feed_forward.up_proj", "feed_forward.down_proj")
MOE = ("feed_forward.router", "feed_forward.shared_expert.gate_proj", "feed_forward.shared_expert.up_proj",
       "feed_forward.shared_expert.down_proj")
# config_keys' rules for its own tensors: the router, the fused experts [experts, hidden, 2 x ff] / [experts, ff,
# hidden] (ff: its intermediate_size), the shared expert, and the dense layers' MLP (intermediate_size_mlp)
SHAPES = (
    Shape("feed_forward.router.weight", 0, size("experts")), Shape("feed_forward.router.weight", 1, size("embd")),
    Shape("feed_forward.experts.gate_up_proj", 0, size("experts")),
    Shape("feed_forward.experts.gate_up_proj", 1, size("embd")),
    Shape("feed_forward.experts.gate_up_proj", 2, size("ff", times=2)),
    Shape("feed_forward.experts.down_proj", 0, size("experts")),
    Shape("feed_forward.experts.down_proj", 1, size("ff")), Shape("feed_forward.experts.down_proj", 2, size("embd")),
    *(Shape(f"feed_forward.shared_expert.{w}_proj.weight", d, size(q)) for w in ("gate", "up")
      for d, q in ((0, "ff"), (1, "embd"))),
    Shape("feed_forward.shared_expert.down_proj.weight", 0, size("embd")),
    Shape("feed_forward.shared_expert.down_proj.weight", 1, size("ff")),
    *(Shape(f"feed_forward.{w}_proj.weight", d, size(q)) for w in ("gate", "up")
      for d, q in ((0, "ff_mlp"), (1, "embd"))),
    Shape("feed_forward.down_proj.weight", 0, size("embd")), Shape("feed_forward.down_proj.weight", 1, size("ff_mlp")),
)
# llama.cpp's fixed values for the architecture (models/llama4.cpp load_arch_hparams), against the config's keys
FIXED = (("attention_chunk_size", 8192, "chunked attention over chunks of 8192 tokens"),
         ("no_rope_layer_interval", 4, "every 4th layer without RoPE"),
         ("floor_scale", 8192, "an attention temperature floor scale of 8192"),
         ("attn_scale", 0.1, "an attention temperature scale of 0.1"),
         ("attn_temperature_tuning", True, "attention temperature tuning"))


class ExpertColumnsTransposed(Wrapper):
    """Columns [lo, hi) of each expert's matrix, transposed: [experts, a, b] -> [experts, hi - lo, a]
    (`data_torch.transpose(-1, -2).split(...)` of Llama4Model.modify_tensors). A band is whole experts."""

    def __init__(self, base: Tensor, lo: int, hi: int, name: str):
        if len(base.shape) != 3 or not 0 <= lo < hi <= base.shape[2]:
            raise CkptError(f"{base.name}: {list(base.shape)} is not [experts, rows, columns] with columns {lo}:{hi}")
        self.base, self.lo, self.hi, self.name, self.home = base, lo, hi, name, base.home
        self.shape = (base.shape[0], hi - lo, base.shape[1])
        self.row_align = None if base.row_align is None else 1

    dtype = property(lambda self: self.base.dtype)  # the base's, asked when needed (planning needs no torch)
    dtype_name = property(lambda self: self.base.dtype_name)

    @property
    def source_bytes(self):
        return self.base.source_bytes * (self.hi - self.lo) // self.base.shape[2]

    def read(self, start, stop, device, scratch=None):
        x = read_rows(self.base, start, stop, device, scratch)
        return x[:, :, self.lo:self.hi].transpose(1, 2).contiguous()


class ExpertsFused(Tensor):
    """The inverse for reading back: per-expert matrices [experts, r_i, c] transposed and joined along their
    rows, [experts, c, sum r_i] (`experts.gate_up_proj` from `ffn_gate_exps` and `ffn_up_exps`)."""

    row_align = 1

    def __init__(self, name: str, parts: list[Tensor]):
        first = parts[0]
        for p in parts:
            if len(p.shape) != 3 or (p.shape[0], p.shape[2]) != (first.shape[0], first.shape[2]):
                raise CkptError(f"{name}: {p.name} {list(p.shape)} and {first.name} {list(first.shape)} are not one "
                                "layer's experts")
        self.name, self.parts, self.home = name, list(parts), first.home
        self.shape = (first.shape[0], first.shape[2], sum(p.shape[1] for p in parts))
        self.row_align = None if any(p.row_align is None for p in parts) else 1

    @property
    def dtype(self):  # (gate and up may be stored in two types: the wider one's values)
        out = self.parts[0].dtype
        for p in self.parts[1:]:
            out = torch.promote_types(out, p.dtype)
        return out

    def natural_source(self):
        return self.parts[0]

    @property
    def source_bytes(self):
        return sum(p.source_bytes for p in self.parts)

    def read(self, start, stop, device, scratch=None):
        return torch.cat([read_rows(p, start, stop, device).to(self.dtype).transpose(1, 2) for p in self.parts],
                         dim=2).contiguous()


def _hparams(x_hparams: dict) -> dict:
    """Llama4Model.__init__: `intermediate_size` (the experts') kept as `intermediate_size_moe`, the dense layers'
    `intermediate_size_mlp` as `intermediate_size`."""
    hp = dict(x_hparams)
    hp["intermediate_size_moe"] = hp["intermediate_size"]
    hp["intermediate_size"] = hp["intermediate_size_mlp"]
    return hp


class Llama4(Llama):
    def source_name(self, name: str) -> str | None:
        """LlamaModel.filter_tensors (`text_model.` cut) then TextModel's (the vision side left out)."""
        return text_model_name(name.replace("text_model.", ""))

    def check(self, x: Export, hf_arch: str) -> None:
        """What llama.cpp's llama4 loader needs of the config: experts (it refuses a model without), and MoE layers
        where the interleave step puts them (it has no per-layer list: a block's tensors and the config's
        `moe_layers` must agree with it); where the config sets what llama.cpp fixes for the architecture, a
        note."""
        hp = x.hparams
        where = x.config_path
        if not x.n_expert:
            raise CkptError(f"{where}: num_local_experts is {hp.get('num_local_experts')!r}; llama.cpp's llama4 "
                            "loader refuses a model without experts")
        for key in ("intermediate_size_mlp", "interleave_moe_layer_step"):
            if hp.get(key) is None:
                raise CkptError(f"{where}: has no {key}, which llama.cpp's converter writes for a llama4 GGUF")
        step = hp["interleave_moe_layer_step"]
        moe = [i for i in range(x.n_block) if (i + 1) % step == 0]
        for i in range(x.n_block):
            want = "feed_forward.router.weight" if i in moe else "feed_forward.gate_proj.weight"
            if x.tensor_shapes and f"model.layers.{i}.{want}" not in x.tensor_shapes:
                raise CkptError(f"{where}: interleave_moe_layer_step is {step}, making block {i} "
                                f"{'an MoE' if i in moe else 'a dense'} layer in llama.cpp, but the weights have no "
                                f"model.layers.{i}.{want}")
        if hp.get("moe_layers") is not None and list(hp["moe_layers"]) != moe:
            raise CkptError(f"{where}: moe_layers is {show(hp['moe_layers'])} but interleave_moe_layer_step {step} "
                            f"makes llama.cpp's MoE layers {show(moe)} (it reads no per-layer list)")
        full = "layer_types" in hp and all(kind == "full_attention" for kind in hp["layer_types"])
        for key, value, what in FIXED:
            if hp.get(key) is not None and hp[key] != value and not (full and key == "attention_chunk_size"):
                x.notes.append(f"config.json {key} is {show(hp[key])}: llama.cpp's llama4 has {what} whatever the "
                               "GGUF says")
        rope_layers = hp.get("no_rope_layers")
        fixed = [1] * x.n_block if full else [int((i + 1) % 4 != 0) for i in range(x.n_block)]
        if isinstance(rope_layers, list) and rope_layers[:x.n_block] != fixed:
            x.notes.append(f"config.json no_rope_layers is {show(rope_layers)}: llama.cpp's llama4 has RoPE in "
                           f"{'every layer (all are full attention)' if full else 'all but every 4th layer'} "
                           "whatever the GGUF says")
        if hp.get("use_qk_norm") is not None and hp["use_qk_norm"] != (x.n_expert != 128):
            x.notes.append(f"config.json use_qk_norm is {hp['use_qk_norm']}: llama.cpp's llama4 normalizes q and k "
                           "by the expert count instead (unless there are 128)")

    def tensors(self, x: Export, name: str, t: Tensor) -> list[tuple[str, Tensor]]:
        """Llama4Model.modify_tensors: the fused experts split and transposed, then LlamaModel's (no permutation)."""
        if "gate_up_proj" in name:
            if len(t.shape) != 3 or t.shape[2] % 2:
                raise CkptError(f"{x.where}: tensor {name!r} is {list(t.shape)}, not [experts, hidden, 2 x ff] as "
                                "llama.cpp's converter splits it")
            half = t.shape[2] // 2
            out = []
            for w, lo in (("gate_proj", 0), ("up_proj", half)):
                hf = name.replace("gate_up_proj", f"{w}.weight")
                out += super().tensors(x, hf, ExpertColumnsTransposed(t, lo, lo + half, hf))
            return out
        if name.endswith("down_proj"):
            if len(t.shape) != 3:
                raise CkptError(f"{x.where}: tensor {name!r} is {list(t.shape)}, not [experts, ff, hidden] as "
                                "llama.cpp's converter transposes it")
            name += ".weight"
            t = ExpertColumnsTransposed(t, 0, t.shape[2], name)
        return super().tensors(x, name, t)

    def parameters(self, w, x: Export, ftype: int) -> list[str]:
        """Llama4Model.set_gguf_parameters: LlamaModel's on the swapped feed-forward sizes, then the interleave
        step, the experts' feed-forward length, and a sliding window of 0 where every layer is full attention."""
        from ckpt.families.llm.text import text_parameters

        hp = _hparams(x.hparams)
        notes = text_parameters(w, self, hp, x.rope, x.n_block, ftype)
        w.add_interleave_moe_layer_step(hp["interleave_moe_layer_step"])
        w.add_expert_feed_forward_length(hp["intermediate_size_moe"])
        if "layer_types" in hp and all(kind == "full_attention" for kind in hp["layer_types"]):
            w.add_sliding_window(0)
            notes.append("llama4.attention.sliding_window 0 (every layer full attention, as llama.cpp's converter "
                         "writes it): llama.cpp 0c1e57098 loads such a file but aborts evaluating it "
                         "(GGML_ASSERT f_attn_temp_scale != 0)")
        return notes

    # ------------------------------------------------------------------ reading back (GGUF -> HF)

    def hf_modules(self, n_blocks: int) -> list[str]:
        """Every block's attention and norms with both kinds of feed-forward (gguf's table names what a block
        has); the fused experts are joined in `read_tensor`."""
        return super().hf_modules(n_blocks) + [f"model.layers.{i}.{m}" for i in range(n_blocks)
                                               for m in DENSE + MOE]

    def read_config(self, r: Readback) -> None:
        """Llama4TextConfig from the metadata: the experts' and the dense layers' feed-forward sizes, the expert
        counts and interleave step, the sliding window's full-attention case, and Llama 3 RoPE parameters that
        give the GGUF's `rope_freqs.weight`."""
        from ckpt.quant.gguf_llm import Meta

        import gguf

        K = gguf.Keys
        m = Meta(r.header, self.arch)
        cfg = r.cfg
        n_blocks = cfg["num_hidden_layers"]
        step = m.integer(K.LLM.INTERLEAVE_MOE_LAYER_STEP)
        n_expert = m.integer(K.LLM.EXPERT_COUNT)
        used = m.integer(K.LLM.EXPERT_USED_COUNT)
        if used > n_expert:
            raise m.bad(m.key(K.LLM.EXPERT_USED_COUNT), used, f"more than the {n_expert} experts")
        expert_ff = m.integer(K.LLM.EXPERT_FEED_FORWARD_LENGTH)
        moe = [i for i in range(n_blocks) if (i + 1) % step == 0]
        for i in range(n_blocks):
            kind = "ffn_gate_exps" if i in moe else "ffn_gate"
            if f"blk.{i}.{kind}.weight" not in r.stored:
                raise m.bad(m.key(K.LLM.INTERLEAVE_MOE_LAYER_STEP), step,
                            f"but the file has no blk.{i}.{kind}.weight (block {i} is {'MoE' if i in moe else 'dense'}"
                            " at that step)")
        for name, t in r.stored.items():  # (torch order: [experts, ff, hidden], down [experts, hidden, ff])
            kind = name.rsplit(".", 2)[-2]
            shape = list(t.stored_shape)
            if kind in ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"):  # HF's shared expert: the experts' ff
                if len(shape) != 2 or shape[1 if kind == "ffn_down_shexp" else 0] != expert_ff:
                    raise m.bad(m.key(K.LLM.EXPERT_FEED_FORWARD_LENGTH), expert_ff, f"but {name} is {shape}")
            if kind not in ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
                continue
            if len(shape) != (2 if kind == "ffn_gate_inp" else 3) or shape[0] != n_expert:
                raise m.bad(m.key(K.LLM.EXPERT_COUNT), n_expert, f"but {name} is {shape}")
            if kind != "ffn_gate_inp" and shape[2 if kind == "ffn_down_exps" else 1] != expert_ff:
                raise m.bad(m.key(K.LLM.EXPERT_FEED_FORWARD_LENGTH), expert_ff, f"but {name} is {shape}")
        window = r.header.value(m.key(K.Attention.SLIDING_WINDOW))
        cfg.update(architectures=["Llama4ForCausalLM"], model_type="llama4_text",
                   intermediate_size_mlp=cfg["intermediate_size"], intermediate_size=expert_ff,
                   num_local_experts=n_expert, num_experts_per_tok=used, interleave_moe_layer_step=step,
                   moe_layers=moe, attention_chunk_size=None if window == 0 else 8192,
                   no_rope_layers=[1] * n_blocks if window == 0 else [int((i + 1) % 4 != 0) for i in range(n_blocks)],
                   use_qk_norm=n_expert != 128)  # llama.cpp's use_kq_norm: all but the 17B-128E model type
        cfg.pop("layer_types", None)
        theta = cfg.pop("rope_theta")
        rope = {"rope_type": "default", "rope_theta": theta}
        if "rope_freqs.weight" in r.stored:
            rope = _llama3_rope(r, theta, cfg["head_dim"])
            r.into_config["rope_freqs.weight"] = "config.json rope_parameters (Llama 3 RoPE scaling)"
            r.notes.append("config.json rope_parameters: Llama 3 RoPE scaling fitted to rope_freqs.weight (the "
                           "original's frequency factors and context length are one of many sets that give those "
                           "factors)")
        cfg["rope_parameters"] = rope
        cfg.pop("rope_scaling", None)

    def blocks_with(self, r: Readback, suffix: str) -> set[int] | None:
        """The MoE blocks' tensors in the blocks the interleave step makes MoE layers, the dense MLP's in the
        others."""
        n, step = r.cfg["num_hidden_layers"], r.cfg["interleave_moe_layer_step"]
        moe = {i for i in range(n) if (i + 1) % step == 0}
        if suffix.startswith(("ffn_gate_inp.", "ffn_gate_exps.", "ffn_up_exps.", "ffn_down_exps.", "ffn_gate_shexp.",
                              "ffn_up_shexp.", "ffn_down_shexp.")):
            return moe
        if suffix.startswith(("ffn_gate.", "ffn_up.", "ffn_down.")):
            return set(range(n)) - moe
        return None

    def in_place(self, gname: str) -> bool:
        """The experts' tensors are read back transposed (and gate / up joined): none stands in its GGUF tensor's
        place, so a GGUF -> GGUF conversion takes them as stored (and refuses them changed)."""
        return not gname.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"))

    def read_tensor(self, r: Readback, gname: str) -> list[tuple[str, Tensor]]:
        """`ffn_gate_exps` + `ffn_up_exps` -> `experts.gate_up_proj` (read with the up half, the gate half giving
        nothing), `ffn_down_exps` -> `experts.down_proj`, each transposed back; the rest by the table."""
        parts = gname.split(".")
        if len(parts) == 4 and parts[2] in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            prefix = f"model.layers.{parts[1]}.feed_forward.experts"
            if parts[2] == "ffn_gate_exps":
                return []
            if parts[2] == "ffn_down_exps":
                v = r.value(gname, f"{prefix}.down_proj")
                return [(f"{prefix}.down_proj", ExpertColumnsTransposed(v, 0, v.shape[2], f"{prefix}.down_proj"))]
            gate = f"blk.{parts[1]}.ffn_gate_exps.weight"
            if gate not in r.stored:
                raise CkptError(f"{r.path}: tensor {gname} has no {gate} to be joined with; nothing was written")
            hf = f"{prefix}.gate_up_proj"
            return [(hf, ExpertsFused(hf, [r.value(gate, hf), r.value(gname, hf)]))]
        return super().read_tensor(r, gname)


def _llama3_rope(r: Readback, theta: float, head_dim: int) -> dict:
    """Llama 3 RoPE parameters whose factors (LlamaModel.generate_extra_tensors) are `rope_freqs.weight`: the
    factor is the largest; the wavelengths left at 1 and those divided by the factor fix the band edges; the
    smoothed ones between them fit the low/high frequency factors (only their ratios to the context length count:
    the context length is rounded to an integer and the factors scaled with it). Checked by computing the factors
    again as the reference does."""
    t = r.stored["rope_freqs.weight"]
    if t.quantized or len(t.stored_shape) != 1 or t.stored_shape[0] != head_dim // 2:
        raise CkptError(f"{r.path}: tensor rope_freqs.weight is {t.type_name} {list(t.stored_shape)}, not the "
                        f"{head_dim // 2} F32 factors of Llama 3 RoPE scaling; nothing was written")
    factors = [float(v) for v in r.value("rope_freqs.weight", "rope_freqs.weight").read_all(torch.device("cpu"))]
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    waves = [2 * math.pi / float(f) for f in freqs]
    factor = max(factors)
    bad = next((v for v in factors if not (math.isfinite(v) and 1.0 <= v <= factor)), None)
    if bad is not None or factors != sorted(factors):
        raise CkptError(f"{r.path}: tensor rope_freqs.weight holds {show(factors)}, not Llama 3 RoPE scaling "
                        "factors (from 1, rising to the scaling factor); nothing was written")
    ones = [w for w, v in zip(waves, factors) if v == 1.0]
    full = [w for w, v in zip(waves, factors) if v == factor and factor > 1.0]
    mid = [(w, v) for w, v in zip(waves, factors) if 1.0 < v < factor]
    # wavelength w is smoothed with s = (old / w - low) / (high - low) and factor 1 / ((1 - s) / f + s)
    smooth = [(w, (1 / v - 1 / factor) / (1 - 1 / factor)) for w, v in mid]
    lo_edge = max(ones, default=0.0)  # the longest wavelength left alone
    hi_edge = min(full, default=2 * max(waves))  # the shortest one divided by the factor
    if len(smooth) >= 2:
        (w1, s1), (w2, s2) = smooth[0], smooth[-1]
        a = (s1 - s2) / (1 / w1 - 1 / w2)  # s = a / w + b, a = old / (high - low), b = -low / (high - low)
        b = s1 - a / w1
        if not b < 0 < a:
            raise CkptError(f"{r.path}: tensor rope_freqs.weight's smoothed factors fit no Llama 3 RoPE scaling; "
                            "nothing was written")
        high, old = 1 - 1 / b, a * (1 - 1 / b - 1)
    elif smooth:
        (w1, s1), = smooth
        old = (w1 + hi_edge) / 2  # between the smoothed wavelength and the first one divided by the factor
        high = 1 + (old / w1 - 1) / s1
    else:
        old = (lo_edge + hi_edge) / 2 if ones else hi_edge / 2
        high = old / ((lo_edge + old) / 2) if ones else 2.0
    scale = max(1, round(old)) / old  # the same factors with an integer context length
    rope = {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": scale,
            "high_freq_factor": high * scale, "original_max_position_embeddings": max(1, round(old))}
    again = llama3_rope_factors(rope, {"head_dim": head_dim})
    if not torch.allclose(again, torch.tensor(factors), rtol=1e-5, atol=0):
        raise CkptError(f"{r.path}: tensor rope_freqs.weight holds {show(factors)}, factors no Llama 3 RoPE scaling "
                        "gives; nothing was written")
    return rope


ARCH = Llama4("llama4", "Llama4ForCausalLM", "llama4_text", LLAMA4_LAYER,
              hf_classes=("Llama4ForConditionalGeneration", "Llama4ForCausalLM"), llama_params=True, vocab="gpt2",
              params="llama4", shape_rules=SHAPES)
