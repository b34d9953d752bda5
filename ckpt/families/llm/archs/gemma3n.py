"""`gemma3n` (Gemma3NModel in the reference's conversion/gemma.py, a Gemma3Model): Gemma 3n's language model, from a
text-only `Gemma3nForCausalLM` or a `Gemma3nForConditionalGeneration` folder without `--mmproj` (its vision and
audio towers and their embedders left out, `ckpt.families.llm.multimodal`).

What the reference does differently from Gemma 3: no norm shift (Gemma 3n's RMSNorm scales by the weight itself);
`*_scale` tensors named `*_scale.weight` (filter_tensors); the token and per-layer embeddings padded with zero rows to
`vocab_size` (the vision / audio token slots) instead of cut to the tokenizer; the three AltUp projections and the
three AltUp unembedding projections each stacked into one tensor; the vocabulary read over `vocab_size` (not
`vocab_size_per_layer_input`); and its own keys after Gemma 3's (AltUp, per-layer input size, shared KV layers, the
activation sparsity as normal quantiles, the sliding-window pattern from `layer_types`).

Not read back (no HF name table for the stacked AltUp tensors yet): `readable=False`."""

from __future__ import annotations

import math

from ckpt.lazy import torch

from ckpt.errors import CkptError
from ckpt.families.llm.arch import Export
from ckpt.families.llm.archs.gemma3 import Gemma3
from ckpt.families.llm.multimodal import text_model_name
from ckpt.families.llm.tensors import Stacked
from ckpt.io.tensors import Tensor

GEMMA3N_LAYER = ()  # not read back
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

    @property
    def natural_dtype(self):
        return self.base.natural_dtype

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


ARCH = Gemma3n("gemma3n", "Gemma3nForCausalLM", "gemma3n_text", GEMMA3N_LAYER,
               hf_classes=("Gemma3nForCausalLM", "Gemma3nForConditionalGeneration"), params="gemma3", vocab="gemma3n",
               readable=False)
