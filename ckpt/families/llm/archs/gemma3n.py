"""`gemma3n` (Gemma3NModel in the reference's conversion/gemma.py, a Gemma3Model): Gemma 3n's language model, from a
text-only `Gemma3nForCausalLM` or a `Gemma3nForConditionalGeneration` folder without `--mmproj` (its vision and
audio towers and their embedders left out, `ckpt.families.llm.multimodal`).

What the reference does differently from Gemma 3: no norm shift (Gemma 3n's RMSNorm scales by the weight itself);
`*_scale` tensors named `*_scale.weight` (filter_tensors); the token and per-layer embeddings padded with zero rows to
`vocab_size` (the vision / audio token slots) instead of cut to the tokenizer; the three AltUp projections and the
three AltUp unembedding projections each stacked into one tensor; the vocabulary read over `vocab_size` (not
`vocab_size_per_layer_input`); and its own keys after Gemma 3's (AltUp, per-layer input size, shared KV layers, the
activation sparsity as normal quantiles, the sliding-window pattern from `layer_types`).

Read back (GGUF -> HF) as `Gemma3nForCausalLM`: the AltUp stacks split again, `*_scale.weight` as `*_scale`, the
config from the metadata (Gemma 3's keys, then AltUp, the per-layer input size, the shared KV layers, the activation
sparsity as the fractions whose quantiles were written), each checked against the tensors that show it. What the GGUF
does not hold exactly, and how it is handled:
- `vocab_size_per_layer_input`: the converter padded the per-layer embeddings with zero rows to `vocab_size` and
  recorded no size. transformers' model gives a token past the table the pad row (row 0); read back with every stored
  row, a padded token gets its zero row, the same values wherever row 0 is zero (as `padding_idx` keeps it). The
  file's padding is told from its last row: zero there and a non-zero row 0 is refused (the size is unknowable).
- the k/v projections and k norms of KV-sharing layers (a release checkpoint has them; transformers' model has no
  module for them and reuses an earlier layer's keys and values): left out, with a note.
- `altup_coef_clip` (a training-time clamp): transformers' default, with a note."""

from __future__ import annotations

import math

from ckpt.lazy import torch

from ckpt.errors import CkptError, file_error
from ckpt.families.llm.arch import Export, Readback
from ckpt.families.llm.archs.gemma2 import GEMMA2_LAYER
from ckpt.families.llm.archs.gemma3 import Gemma3
from ckpt.families.llm.multimodal import text_model_name
from ckpt.families.llm.tensors import Stacked, Unstacked
from ckpt.io.tensors import Tensor, read_rows

GEMMA3N_LAYER = GEMMA2_LAYER + ("self_attn.q_norm", "self_attn.k_norm", "altup.correct_output_scale",
                               "altup.correction_coefs", "altup.modality_router", "altup.prediction_coefs",
                               "altup.router_norm", "laurel.linear_left", "laurel.linear_right",
                               "laurel.post_laurel_norm", "per_layer_input_gate", "per_layer_projection",
                               "post_per_layer_input_norm")
GEMMA3N_TOP = ("model.embed_tokens_per_layer", "model.per_layer_model_projection", "model.per_layer_projection_norm",
               "model.altup_projections", "model.altup_unembed_projections")
KV_SHARED = ("attn_k", "attn_v", "attn_k_norm")  # what a KV-sharing layer of transformers' model has no module for
STACKED_ALTUP = {"altup_proj.weight": "model.altup_projections.{i}.weight",
                 "altup_unembd_proj.weight": "model.altup_unembed_projections.{i}.weight"}
ALTUP = {"altup_unembed_projections": "model.altup_unembed_projections.weight",
         "altup_projections": "model.altup_projections.weight"}  # (checked in this order: the first contains no other)


class ZeroPadded(Tensor):
    """`torch.cat([base, zeros])` to `rows` rows (Gemma3NModel.modify_tensors' padding of the embeddings for the
    vision / audio token slots), band by band: the base's rows as read, zeros after them."""

    def __init__(self, base: Tensor, rows: int):
        self.base, self.name, self.home = base, base.name, base.home
        self.shape = (rows, *base.shape[1:])
        self.row_align = None if base.row_align is None else 1

    dtype = property(lambda self: self.base.dtype)

    def natural_source(self):
        return self.base

    def read(self, start, stop, device, scratch=None):
        have = self.base.rows
        parts = []
        if start < have:
            parts.append(self.base.read(start, min(stop, have), device, scratch))
        if stop > have:
            parts.append(torch.zeros((stop - max(start, have), *self.shape[1:]), dtype=self.dtype, device=device))
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class Gemma3n(Gemma3):
    def source_name(self, name: str) -> str | None:
        """Gemma3NModel.filter_tensors: `*_scale` as `*_scale.weight`, then TextModel's (a VLM's text model)."""
        if name.endswith("_scale"):
            name = name + ".weight"
        return text_model_name(name)

    def check(self, x: Export, hf_arch: str) -> None:
        """What Gemma3NModel asserts or indexes (a value it cannot write is refused here, in one line), and the
        sizes of its own tensors against the config."""
        h, where, n = x.hparams, x.config_path, x.n_block
        if h.get("altup_num_inputs") != 4:
            raise CkptError(f"{where}: altup_num_inputs is {str(h.get('altup_num_inputs'))[:40]}, not the 4 "
                            "llama.cpp's converter supports")
        for key, lo, hi in (("altup_active_idx", 0, 3), ("hidden_size_per_layer_input", 1, 2**32 - 1),
                            ("num_kv_shared_layers", 0, n)):
            v = h.get(key)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise CkptError(f"{where}: {key} is {str(v)[:40]}, not an integer from {lo} to {hi}")
        pattern = h.get("activation_sparsity_pattern")
        if not isinstance(pattern, list) or len(pattern) != n or not all(_number(s) and 0 <= s < 1 for s in pattern):
            raise CkptError(f"{where}: activation_sparsity_pattern is {str(pattern)[:40]}, not {n} fractions from 0 "
                            "to below 1 (one per layer)")
        types = h.get("layer_types")
        if not isinstance(types, list) or len(types) != n or not all(isinstance(t, str) for t in types):
            raise CkptError(f"{where}: layer_types is {str(types)[:40]}, not {n} layer kinds (one per layer)")
        per_layer = h["hidden_size_per_layer_input"] * n
        for name, dim in (("model.embed_tokens_per_layer.weight", 1), ("model.per_layer_model_projection.weight", 0)):
            shape = x.tensor_shapes.get(name)
            if shape is not None and (len(shape) != 2 or shape[dim] != per_layer):
                raise CkptError(f"{where}: hidden_size_per_layer_input x num_hidden_layers is "
                                f"{h['hidden_size_per_layer_input']} x {n} = {per_layer} but {name} is {list(shape)}")
        for name, shape in x.tensor_shapes.items():
            if (".embed_tokens" in name) and shape and shape[0] > h["vocab_size"]:
                raise CkptError(f"{where}: vocab_size is {h['vocab_size']} but {name} has {shape[0]} rows")
        super().check(x, hf_arch)

    def tensors(self, x: Export, name: str, t: Tensor) -> list[tuple[str, Tensor]]:
        """Gemma3NModel.modify_tensors: the embeddings padded to vocab_size, the AltUp projections stacked, the rest
        as Gemma 3's (no norm shift: `norm_shift` is 0)."""
        if "embed_tokens.weight" in name or "embed_tokens_per_layer" in name:
            vocab = x.hparams.get("vocab_size", 262400)
            if t.shape and t.shape[0] < vocab:
                t = ZeroPadded(t, vocab)
            return [(x.gguf_name(self, name), t)]
        for part, merged in ALTUP.items():
            if part in name:
                return self._altup(x, part, merged, name, t)
        return super().tensors(x, name, t)

    def _altup(self, x: Export, part: str, merged: str, name: str, t: Tensor) -> list[tuple[str, Tensor]]:
        """One of the three AltUp (un)embedding projections; the three stacked (in index order) once all are seen."""
        index = next((i for i in range(3) if f".{i}." in name), None)
        if index is None:
            raise CkptError(f"{x.where}: tensor {name!r} is not AltUp projection 0, 1 or 2 (llama.cpp's converter "
                            "stacks those three)")
        group = x.pending.setdefault(part, {})
        group[index] = t
        if len(group) < 3:
            return []
        del x.pending[part]
        gname = x.gguf_name(self, merged)
        return [(gname, Stacked(gname, [group[i] for i in range(3)]))]

    def finish(self, x: Export) -> None:
        """An AltUp group left incomplete is refused (the reference would leave the tensor out silently, and
        llama.cpp cannot load the file)."""
        for part, group in x.pending.items():
            missing = next(i for i in range(3) if i not in group)
            raise CkptError(f"{x.where}: AltUp projection {part}.{missing} is missing (llama.cpp's converter stacks "
                            f"{part}.0-2 into one tensor)")

    def parameters(self, w, x: Export, ftype: int) -> list[str]:
        """Gemma3NModel.set_gguf_parameters: Gemma 3's, then AltUp, the per-layer input size, the shared KV layers,
        the activation sparsity as standard-normal quantiles (float32, as torch computes them there) and the
        sliding-window layers."""
        notes = super().parameters(w, x, ftype)
        h = x.hparams
        w.add_altup_active_idx(h["altup_active_idx"])
        w.add_altup_num_inputs(h["altup_num_inputs"])
        w.add_embedding_length_per_layer_input(h["hidden_size_per_layer_input"])
        w.add_shared_kv_layers(h["num_kv_shared_layers"])
        normal = torch.distributions.normal.Normal(0, 1)
        w.add_activation_sparsity_scale([normal.icdf(torch.tensor(s, dtype=torch.float32)).item()
                                         for s in h["activation_sparsity_pattern"]])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in h["layer_types"]])
        return notes


    # ------------------------------------------------------------------ reading back (GGUF -> HF)

    def hf_modules(self, n_blocks: int) -> list[str]:
        return super().hf_modules(n_blocks) + list(GEMMA3N_TOP)

    def read_config(self, r: Readback) -> None:
        """Gemma3nTextConfig: Gemma 3's keys (less the query scale and attention softcapping it has not; its
        sliding-window layers by llama.cpp's gemma3n period of 5 where the file has no pattern), then each of the
        architecture's own from the metadata, checked against the tensors that show it."""
        import gguf

        from ckpt.families.llm.readback_keys import layer_types, swa_layers
        from ckpt.quant.gguf_llm import Meta

        K = gguf.Keys
        super().read_config(r)
        m, cfg, stored = Meta(r.header, self.arch), r.cfg, r.stored
        n, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
        for key in ("query_pre_attn_scalar", "attn_logit_softcapping"):
            cfg.pop(key, None)
        cfg["sliding_window"] = m.integer(K.Attention.SLIDING_WINDOW)  # llama.cpp's gemma3n requires it
        cfg["layer_types"] = types = layer_types(swa_layers(m, n, 5))
        cfg["intermediate_size"] = [cfg["intermediate_size"]] * n
        n_alt = m.integer(K.LLM.ALTUP_NUM_INPUTS, lo=2)
        active = m.integer(K.LLM.ALTUP_ACTIVE_IDX, lo=0)
        if active >= n_alt:
            raise m.bad(m.key(K.LLM.ALTUP_ACTIVE_IDX), active, f"not below {m.key(K.LLM.ALTUP_NUM_INPUTS)} ({n_alt})")
        per = m.integer(K.LLM.EMBD_LENGTH_PER_LAYER_INP)
        emb = stored.get("per_layer_token_embd.weight")
        if emb is None:
            raise file_error(r.path, "tensor per_layer_token_embd.weight is missing; nothing was written")
        rows = emb.stored_shape[0] if emb.stored_shape else 0
        laurel = stored.get("blk.0.laurel_l.weight")
        rank = laurel.stored_shape[0] if laurel is not None and laurel.stored_shape else 0
        sizes = {"per_layer_token_embd": ((rows, n * per), K.LLM.EMBD_LENGTH_PER_LAYER_INP),
                 "per_layer_model_proj": ((n * per, hidden), K.LLM.EMBD_LENGTH_PER_LAYER_INP),
                 "per_layer_proj_norm": ((per,), K.LLM.EMBD_LENGTH_PER_LAYER_INP),
                 "inp_gate": ((per, hidden), K.LLM.EMBD_LENGTH_PER_LAYER_INP),
                 "proj": ((hidden, per), K.LLM.EMBD_LENGTH_PER_LAYER_INP),
                 "altup_proj": ((n_alt - 1, hidden, hidden), K.LLM.ALTUP_NUM_INPUTS),
                 "altup_unembd_proj": ((n_alt - 1, hidden, hidden), K.LLM.ALTUP_NUM_INPUTS),
                 "altup_correct_coef": ((n_alt, n_alt), K.LLM.ALTUP_NUM_INPUTS),
                 "altup_predict_coef": ((n_alt * n_alt, n_alt), K.LLM.ALTUP_NUM_INPUTS),
                 "altup_router": ((n_alt, hidden), K.LLM.ALTUP_NUM_INPUTS),
                 "laurel_l": ((rank, hidden), K.LLM.EMBEDDING_LENGTH),
                 "laurel_r": ((hidden, rank), K.LLM.EMBEDDING_LENGTH)}
        for name, t in stored.items():
            parts = name.split(".")
            want = sizes.get(parts[2] if parts[0] == "blk" and len(parts) == 4 else parts[0])
            if want is not None and tuple(t.stored_shape) != want[0]:
                raise m.bad(m.key(want[1]), m.integer(want[1]), f"but {name} is {list(t.stored_shape)}, not "
                                                                f"{list(want[0])}")
        shared = self._kv_shared(m, r, n, types)
        cfg.update(vocab_size_per_layer_input=self._per_layer_vocab(r, rows), hidden_size_per_layer_input=per,
                   altup_num_inputs=n_alt, altup_active_idx=active, altup_correct_scale=True, laurel_rank=rank,
                   num_kv_shared_layers=shared, activation_sparsity_pattern=self._sparsity(m, n))
        r.notes.append("config.json altup_coef_clip: transformers' default (the GGUF does not record this clamp of "
                       "the AltUp coefficients, applied in training only)")

    def _kv_shared(self, m, r: Readback, n: int, types: list[str]) -> int:
        """`attention.shared_kv_layers`: the last layers reuse an earlier layer's keys and values (transformers
        needs a layer of each of their kinds before them); every layer before them has its own k/v projections.
        Those a KV-sharing layer has (a release checkpoint's) are left out: transformers' model has no module for
        them."""
        import gguf

        key = m.key(gguf.Keys.Attention.SHARED_KV_LAYERS)
        shared = m.integer(gguf.Keys.Attention.SHARED_KV_LAYERS, 0, lo=0)
        first = n - shared
        if shared and (first < 1 or not set(types[first:]) <= set(types[:first])):
            raise m.bad(key, shared, f"but layers {first}-{n - 1} would share keys and values with no earlier layer "
                                     "of their kind (attention.sliding_window_pattern)")
        for i in range(first):
            for kind in KV_SHARED:
                if f"blk.{i}.{kind}.weight" not in r.stored:
                    raise m.bad(key, shared, f"but blk.{i}.{kind}.weight is missing (only the last {shared} of "
                                             f"{n} layers share keys and values)")
        left = [g for g in r.stored if g.startswith("blk.") and int(g.split(".")[1]) >= first
                and g.split(".")[2] in KV_SHARED]
        for g in left:
            r.into_config[g] = "left out: a KV-sharing layer's, which transformers' model has no module for"
        if left:
            r.notes.append(f"{len(left)} k/v tensors of the {shared} KV-sharing layers left out (e.g. {left[0]}): "
                           "transformers' model reuses an earlier layer's keys and values there and has none")
        return shared

    def _per_layer_vocab(self, r: Readback, rows: int) -> int:
        """vocab_size_per_layer_input: every stored row (see the module docstring), refused where the converter's
        zero padding (a zero last row) is not what transformers gives a token past the table (row 0, when it is not
        zero)."""
        if rows < 1:
            raise file_error(r.path, "tensor per_layer_token_embd.weight has no rows")
        t = r.value("per_layer_token_embd.weight", "model.embed_tokens_per_layer.weight")
        cpu = torch.device("cpu")
        first, last = read_rows(t, 0, 1, cpu), read_rows(t, rows - 1, rows, cpu)
        if rows > 1 and not last.any() and first.any():
            raise file_error(r.path, "tensor per_layer_token_embd.weight ends in zero rows (llama.cpp's padding past "
                                     "vocab_size_per_layer_input, which the GGUF does not record) and its row 0 is "
                                     "not zero: the original table's size cannot be recovered; nothing was written")
        return rows

    def _sparsity(self, m, n: int) -> list[float]:
        """activation_sparsity_pattern: the fraction each layer's `activation_sparsity_scale` (its standard-normal
        quantile, as float32 torch computes it) was written from: the shortest decimal whose quantile is the stored
        value exactly, else the nearest float (-inf: 0, no sparsity)."""
        import gguf

        key = m.key(gguf.Keys.LLM.ACTIVATION_SPARSITY_SCALE)
        scales = m.header.value(key)
        if (not isinstance(scales, list) or len(scales) != n or
                any(isinstance(s, bool) or not isinstance(s, (int, float)) or math.isnan(s) or s == math.inf
                    for s in scales)):
            raise m.bad(key, scales[:8] if isinstance(scales, list) else scales,
                        f"not {n} standard-normal quantiles (one per block)")
        normal = torch.distributions.normal.Normal(0, 1)

        def quantile(p: float) -> float:
            return normal.icdf(torch.tensor(p, dtype=torch.float32)).item()

        out = []
        for s in scales:
            if s == -math.inf:
                out.append(0.0)
                continue
            p = 0.5 * math.erfc(-s / math.sqrt(2))
            out.append(next((c for c in (round(p, d) for d in range(1, 10)) if 0 < c < 1 and quantile(c) == s), p))
        return out

    def blocks_with(self, r: Readback, suffix: str) -> set[int] | None:
        """k/v projections and k norms in the layers that compute their own (those of KV-sharing layers, where a
        file has them, are left out); every other tensor in every block."""
        if suffix.split(".")[0] not in KV_SHARED:
            return None
        n = r.cfg["num_hidden_layers"]
        first = n - r.cfg["num_kv_shared_layers"]
        return set(range(first)) | {i for i in range(first, n) if f"blk.{i}.{suffix}" in r.stored}

    def in_place(self, gname: str) -> bool:
        """The stacked AltUp projections are rebuilt (three HF tensors), not in place."""
        return gname not in STACKED_ALTUP

    def read_tensor(self, r: Readback, gname: str) -> list[tuple[str, Tensor]]:
        """The stacked AltUp projections as the three HF matrices; `altup.correct_output_scale` without the
        `.weight` the converter added; the rest by the table."""
        if gname in STACKED_ALTUP:
            template = STACKED_ALTUP[gname]
            v = r.value(gname, template.format(i="X"))
            return [(template.format(i=i), Unstacked(v, i, template.format(i=i))) for i in range(v.shape[0])]
        hf = r.names.get(gname, "")
        if hf.endswith("_scale.weight"):
            hf = hf[:-len(".weight")]
            return [(hf, r.value(gname, hf))]
        return super().read_tensor(r, gname)


ARCH = Gemma3n("gemma3n", "Gemma3nForCausalLM", "gemma3n_text", GEMMA3N_LAYER,
               hf_classes=("Gemma3nForCausalLM", "Gemma3nForConditionalGeneration"), params="gemma3", vocab="gemma3n")
