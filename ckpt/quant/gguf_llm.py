"""llama.cpp LLM GGUFs back to Hugging Face transformers names, weights and config.json.

llama.cpp's converter (convert_hf_to_gguf.py) names each HF tensor with gguf's tensor-name tables
(`gguf.get_tensor_name_map(arch, n_blocks).get_name(hf_name)`); reading goes the other way by asking the
same table for the GGUF name of every key the HF model class has, and inverting (what transformers'
own GGUF loader does from an instantiated model; here the keys are listed per architecture in
`ckpt.families.llm`, facts a GGUF writer needs too, so no model is built). Each GGUF tensor must find
its HF name: one that does not is an error, never a dropped key.

What llama.cpp changed on the way, undone here:
- `llama` (Llama, Mistral and other LlamaForCausalLM checkpoints): the rows of q_proj and k_proj were
  permuted per head for llama.cpp's RoPE (`LlamaModel.permute`: rows (2, hd/2) -> (hd/2, 2) in each
  head; k with the key/value head count). The inverse permutation is applied per head, in bands of
  whole heads.
- tied embeddings: a file without `output.weight` ties lm_head to the embeddings (config
  `tie_word_embeddings`), as the HF model had.
- `rope_freqs.weight` (Llama 3 RoPE scaling factors computed by the converter) has no HF tensor; it is
  left out with a note: the factors belong in config.json `rope_scaling`, which GGUF does not record.

config.json comes from the GGUF metadata (`{arch}.embedding_length`, `.block_count`, `.attention.*`,
`.rope.*`, `tokenizer.ggml.*_token_id`) and the tensor shapes (vocabulary, head size). The tokenizer
is not exported (transformers reads it from the .gguf itself).
"""

from __future__ import annotations

import math
import re

from ckpt.errors import file_error
from ckpt.families.llm.arch import LLMArch, Readback
from ckpt.families.llm.architectures import ARCHS
from ckpt.families.llm.tensors import HeadRowsPermuted, Shifted
from ckpt.io.gguf import GGUFStored
from ckpt.io.tensors import Tensor
from ckpt.io.wrapper import Renamed, Wrapper
from ckpt.quant.encoding import Encoding, encoding_of
from ckpt.quant.common import Decoded
from ckpt.report import plural
from ckpt.lazy import numpy as np

SUPPORTED = ", ".join(ARCHS)
DROPPED = {"rope_freqs.weight": "Llama 3 RoPE scaling factors computed by llama.cpp's converter (no HF tensor)"}


def _gguf():
    import gguf

    return gguf


def is_llm(header, stored: dict) -> bool:
    """llama.cpp's tensor names (`blk.N.*`, `token_embd.weight`), as opposed to a diffusion model's own."""
    return any(n.startswith("blk.") or n == "token_embd.weight" for n in stored)


def name_map(arch: LLMArch, n_blocks: int) -> dict[str, str]:
    """GGUF tensor name -> HF name, from gguf's own table for `arch`."""
    gguf = _gguf()
    enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch.arch)
    table = gguf.get_tensor_name_map(enum, n_blocks)
    out = {}
    for name in arch.hf_modules(n_blocks):
        g = table.get_name(name)
        if g is None:
            continue
        for suffix in (".weight", ".bias"):
            out[g + suffix] = name + suffix
    return out


class HeadRowsUnpermuted(Wrapper):
    """Rows of a q/k projection put back in HF order: llama.cpp stored each head's rows as (hd/2, 2), HF
    has (2, hd/2). Bands hold whole heads, so each band is permuted on its own."""

    def __init__(self, base: Tensor, n_heads: int, name: str):
        self.base, self.name, self.home = base, name, base.home
        self.shape = tuple(base.shape)
        self.head = base.rows // n_heads
        self.row_align = None if base.row_align is None else math.lcm(self.head, base.row_align)

    dtype = property(lambda self: self.base.dtype)  # the base's, asked when needed (planning needs no torch)
    dtype_name = property(lambda self: self.base.dtype_name)

    def read(self, start, stop, device, scratch=None):
        x = self.base.read(start, stop, device, scratch)
        rest = x.shape[1:]
        h = (stop - start) // self.head
        return x.reshape(h, self.head // 2, 2, *rest).transpose(1, 2).reshape(stop - start, *rest).contiguous()

    @property
    def encoding(self):
        """A new value in HF order goes back through llama.cpp's permute, then the stored encoding."""
        inner = encoding_of(self.base)
        return None if inner is None else HeadRowsPermutedEncoding(inner, self.head)


class HeadRowsPermutedEncoding(Encoding):
    """Storing a new q/k value of a llama GGUF: permuted back to llama.cpp's row order, then encoded as the
    stored tensor is."""

    def __init__(self, inner, head: int):
        self.inner, self.head = inner, head
        self.label, self.keys, self.note = inner.label, inner.keys, inner.note

    def why_not(self):
        return self.inner.why_not()

    def encode(self, value, report, meter):
        return self.inner.encode(HeadRowsPermuted(value, self.head), report, meter)


class NormUnshifted(Wrapper):
    """A norm weight as HF has it: llama.cpp's converter stored Gemma's `weight + shift` (the RMSNorm scales by
    1 + weight; `LLMArch.norm_shift`), read back as `stored - shift` in float32 (the stored norms are F32)."""

    def __init__(self, base: Tensor, shift: float, name: str):
        self.base, self.shift, self.name, self.home = base, shift, name, base.home
        self.shape, self.row_align = tuple(base.shape), base.row_align

    @property
    def dtype(self):
        from ckpt.lazy import torch

        return self.base.dtype if self.base.dtype in (torch.float16, torch.float32) else torch.float32

    def read(self, start, stop, device, scratch=None):
        return self.base.read(start, stop, device, scratch).to(self.dtype) - self.shift

    @property
    def encoding(self):
        """A new value goes back through the converter's shift, then the stored encoding."""
        inner = encoding_of(self.base)
        return None if inner is None else NormShiftedEncoding(inner, self.shift)


class NormShiftedEncoding(Encoding):
    """Storing a new norm weight of a Gemma GGUF: shifted back as the converter stores it, then encoded as the
    stored tensor is."""

    def __init__(self, inner, shift: float):
        self.inner, self.shift = inner, shift
        self.label, self.keys, self.note = inner.label, inner.keys, inner.note

    def why_not(self):
        return self.inner.why_not()

    def encode(self, value, report, meter):
        return self.inner.encode(Shifted(value, self.shift), report, meter)


class HFNamed(Renamed):
    """A stored GGUF tensor under its HF name (plain GGUF types need no decoding, only the name) that still
    says how it is stored, so --keep-format re-encodes a changed one into its own type."""

    @property
    def encoding(self):
        return encoding_of(self.base)


def _f32(v) -> float:
    """A float32 metadata value as the decimal it was written from (1e-06, not 9.99999997e-07)."""
    return float(str(np.float32(v)))


def _uniform(header, key: str, default=None):
    """A per-model hyperparameter; llama.cpp writes some as per-layer arrays, which must then agree."""
    v = header.value(key, default)
    if isinstance(v, list):
        if not v or any(x != v[0] for x in v):
            raise file_error(header.path, f"metadata {key!r} differs between layers ({v[:8]}...), which "
                                          "one transformers config cannot express")
        v = v[0]
    return v


_MISSING = object()


class Meta:
    """The metadata values config.json is made of, each checked for type and range as it is read: a GGUF
    is input, and a head count of 0 or 'four', a block count of 2^31, a string epsilon must be one line
    naming the key and its value, not a ZeroDivisionError, a reshape error or a loop over 2^31 blocks."""

    def __init__(self, header, arch: str):
        self.header, self.arch = header, arch

    def key(self, template: str) -> str:
        return template.format(arch=self.arch)

    def bad(self, key: str, v, want: str):
        return file_error(self.header.path, f"metadata {key!r} is {v!r}, {want}")

    def _get(self, template: str, default):
        key = self.key(template)
        v = _uniform(self.header, key)
        if v is None and default is _MISSING:
            raise file_error(self.header.path, f"metadata {key!r} is missing (needed for config.json)")
        return key, v

    def integer(self, template: str, default=_MISSING, lo: int = 1) -> int:
        """An integer of at least `lo` (GGUF BOOL is not one)."""
        key, v = self._get(template, default)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise self.bad(key, v, f"not an integer of at least {lo}")
        return v

    def number(self, template: str, default=_MISSING) -> float:
        """A finite number above 0 (eps, RoPE base and factor), as the decimal it was written from."""
        key, v = self._get(template, default)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise self.bad(key, v, "not a finite number above 0")
        return _f32(v)

    def string(self, template: str):
        key, v = self._get(template, None)
        if v is not None and not isinstance(v, str):
            raise self.bad(key, v, "not a string")
        return v


def _rows(meta: Meta, stored: dict[str, GGUFStored], suffixes: tuple[str, ...]) -> dict[str, int]:
    """Rows (torch dim 0) of the tensors whose names end in these suffixes; a scalar there is refused (the
    head counts split its rows, and RoPE unpermutes them)."""
    for n, t in stored.items():
        if n.endswith(suffixes) and not t.stored_shape:
            raise file_error(meta.header.path, f"tensor {n} is a scalar, not the rows of a projection")
    return {n: t.stored_shape[0] for n, t in stored.items() if n.endswith(suffixes)}


def _check_blocks(meta: Meta, n_blocks: int, stored: dict[str, GGUFStored]) -> None:
    """block_count must be the blocks the file has tensors for (0..n-1, each present): the name table is
    built per declared block, and a config with more or fewer layers than the weights does not load. The last
    `nextn_predict_layers` blocks (NextN/MTP layers, which llama.cpp loads where present) may have none."""
    key = meta.key(_gguf().Keys.LLM.BLOCK_COUNT)
    present = {int(m.group(1)) for n in stored if (m := re.match(r"blk\.(\d+)\.", n))}
    nextn = meta.header.value(meta.key(_gguf().Keys.LLM.NEXTN_PREDICT_LAYERS), 0)
    trunk = n_blocks - nextn if isinstance(nextn, int) and not isinstance(nextn, bool) and 0 < nextn < n_blocks \
        else n_blocks
    # exactly 0..n-1 (no set of n: n may be 2^31)
    if not any(len(present) == n and max(present) == n - 1 for n in {n_blocks, trunk}):
        have = f"{plural(len(present), 'block')} ({min(present)}-{max(present)})" if present else "no blk.N tensors"
        gap = next(i for i in range(len(present) + 1) if i not in present)  # the first block with no tensor
        more = f", none for block {gap}" if present and gap < min(n_blocks, max(present)) else ""
        raise meta.bad(key, n_blocks, f"but the file has tensors for {have}{more}")


def _check_heads(meta: Meta, heads: int, kv_heads: int, hidden: int, stored: dict[str, GGUFStored],
                 arch: LLMArch) -> int:
    """The head counts against the q/k projections they split (every block): heads divide q's rows into
    heads of one size, kv heads k's rows into heads of the same size, and (grouped-query attention) the
    kv heads divide the heads; llama's RoPE permutation needs an even head size. Returns the head size."""
    K = _gguf().Keys.Attention
    hk, kvk = meta.key(K.HEAD_COUNT), meta.key(K.HEAD_COUNT_KV)
    if heads % kv_heads:
        raise meta.bad(kvk, kv_heads, f"which does not divide {hk} ({heads})")
    per_head = arch.q_rows_per_head  # 2 where attn_q holds each head's query and its output gate (Qwen3-Next)
    gated = f" x {per_head} (query and gate)" if per_head > 1 else ""
    q_rows = _rows(meta, stored, (".attn_q.weight", ".attn_q.bias"))
    name, rows = next(iter(q_rows.items()), (None, hidden * per_head))
    where = f"the {rows} rows of {name}" if name else f"embedding_length ({hidden})"
    if rows % (heads * per_head):
        raise meta.bad(hk, heads, f"which does not divide {where} into heads{gated}")
    head = rows // (heads * per_head)
    if arch.rope_permute and head % 2:
        raise meta.bad(hk, heads, f"giving heads of {plural(head, 'row')} (of {rows}); llama's RoPE rows come in "
                                  "pairs")
    for n, r in q_rows.items():
        if r != heads * head * per_head:
            raise meta.bad(hk, heads, f"but {n} has {r} rows, not {heads} heads of {head}{gated}")
    for n, r in _rows(meta, stored, (".attn_k.weight", ".attn_k.bias")).items():
        if r != kv_heads * head:
            raise meta.bad(kvk, kv_heads, f"but {n} has {r} rows, not {kv_heads} heads of {head}")
    return head


def _check_complete(header, stored: dict[str, GGUFStored], n_blocks: int, blocks_with=None) -> None:
    """Every block holds the same tensors (or those `blocks_with(suffix)` says: `LLMArch.blocks_with`), and the
    embeddings and final norm are there: a GGUF missing one (llama.cpp refuses to load it) would otherwise become a
    folder whose model transformers fills in at random."""
    per_block: dict[str, set[int]] = {}
    for n in stored:
        if (m := re.match(r"blk\.(\d+)\.(.+)$", n)):
            per_block.setdefault(m.group(2), set()).add(int(m.group(1)))
    for suffix, blocks in sorted(per_block.items()):
        want = blocks_with(suffix) if blocks_with is not None else None
        if want is not None and blocks != want:
            odd = min(blocks - want, default=None)
            if odd is not None:
                raise file_error(header.path, f"tensor blk.{odd}.{suffix} is in a block that has none (only blocks "
                                              f"{sorted(want)[:4]}{', ...' if len(want) > 4 else ''} do in this "
                                              "architecture); nothing was written")
            gap = min(want - blocks)
            raise file_error(header.path, f"tensor blk.{gap}.{suffix} is missing (blocks {sorted(blocks)[:4]}"
                                          f"{', ...' if len(blocks) > 4 else ''} have it); nothing was written")
        if want is None and len(blocks) != n_blocks:
            gap = next(i for i in range(n_blocks) if i not in blocks)
            raise file_error(header.path, f"tensor blk.{gap}.{suffix} is missing (blocks {sorted(blocks)[:4]}"
                                          f"{', ...' if len(blocks) > 4 else ''} have it); nothing was written")
    for top in ("token_embd.weight", "output_norm.weight"):
        if top not in stored:
            raise file_error(header.path, f"tensor {top} is missing; nothing was written")


def derive_config(header, arch: LLMArch, stored: dict[str, GGUFStored]) -> tuple[dict, list[str]]:
    """config.json for the HF model class, from the GGUF metadata and the tensor shapes; and notes. Every
    value is checked (`Meta`) and, where a tensor shows it, against that tensor."""
    K = _gguf().Keys
    m = Meta(header, arch.arch)
    heads = m.integer(K.Attention.HEAD_COUNT)
    kv_heads = m.integer(K.Attention.HEAD_COUNT_KV, heads)
    hidden = m.integer(K.LLM.EMBEDDING_LENGTH)
    emb = stored.get("token_embd.weight")
    if emb is not None and len(emb.stored_shape) != 2:
        raise file_error(header.path, f"tensor token_embd.weight is {list(emb.stored_shape)}, not the [vocabulary, "
                                      "embedding_length] matrix config.json's sizes are read from")
    if emb is not None and emb.stored_shape[-1] != hidden:
        raise m.bad(m.key(K.LLM.EMBEDDING_LENGTH), hidden,
                    f"but token_embd.weight has rows of {emb.stored_shape[-1]}")
    ffn = m.integer(K.LLM.FEED_FORWARD_LENGTH)
    for n, r in _rows(m, stored, (".ffn_up.weight", ".ffn_gate.weight")).items():
        fused = arch.ffn_up_rows if n.endswith(".ffn_up.weight") else 1  # Phi-3's gate and up in one
        if r != ffn * fused:
            raise m.bad(m.key(K.LLM.FEED_FORWARD_LENGTH), ffn,
                        f"but {n} has {r} rows" + (f", not {fused} x {ffn} (gate and up)" if fused > 1 else ""))
    n_blocks = m.integer(K.LLM.BLOCK_COUNT)
    _check_blocks(m, n_blocks, stored)
    cfg = {
        "architectures": [arch.hf_class],
        "model_type": arch.model_type,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": n_blocks,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": _check_heads(m, heads, kv_heads, hidden, stored, arch),
        "rms_norm_eps": m.number(K.Attention.LAYERNORM_RMS_EPS),
        "max_position_embeddings": m.integer(K.LLM.CONTEXT_LENGTH),
        "rope_theta": m.number(K.Rope.FREQ_BASE, 10000.0),
        "tie_word_embeddings": "output.weight" not in stored,
        "hidden_act": "silu",
    }
    if emb is not None:
        cfg["vocab_size"] = emb.stored_shape[0]
    else:
        vocab = m.integer(K.LLM.VOCAB_SIZE, None)
        if vocab is not None:
            cfg["vocab_size"] = vocab
    for field_name, suffixes in arch.bias_flags.items():
        cfg[field_name] = any(n.endswith(suffixes) for n in stored)
    for hf_key, gguf_key in (("bos_token_id", K.Tokenizer.BOS_ID), ("eos_token_id", K.Tokenizer.EOS_ID)):
        v = m.integer(gguf_key, None, lo=0)
        if v is not None:
            cfg[hf_key] = v
    notes = []
    scaling = m.string(K.Rope.SCALING_TYPE)
    if scaling not in (None, "none", ""):
        rope = {"rope_type": scaling, "factor": m.number(K.Rope.SCALING_FACTOR, 1.0)}
        orig = m.integer(K.Rope.SCALING_ORIG_CTX_LEN, None)
        if orig is not None:
            rope["original_max_position_embeddings"] = orig
        cfg["rope_scaling"] = rope
        notes.append(f"config.json rope_scaling {rope} from the GGUF metadata; check it against the original model")
    return cfg, notes


def decode(header, stored: dict[str, GGUFStored], values, summary: str) -> Decoded:
    """The HF view of an LLM GGUF. `values(t, name)`: the dequantized tensor of the quantized stored `t`
    under its HF name, and `summary` the file's type counts: both are `ckpt.quant.gguf`'s, passed in by
    that module's decoder (which calls this one) so that this module need not import it back."""
    arch_name = header.architecture
    arch = ARCHS.get(arch_name or "")
    if arch is None:
        known = arch_name in _gguf().MODEL_ARCH_NAMES.values()
        what = "an LLM architecture ckpt has no HF name table for" if known else "not an architecture gguf knows"
        raise file_error(header.path, f"GGUF architecture {arch_name!r} is {what} (supported LLMs: {SUPPORTED}); "
                                      "nothing was written")
    cfg, notes = derive_config(header, arch, stored)
    names = name_map(arch, cfg["num_hidden_layers"])

    def value(gname: str, hf: str) -> Tensor:
        t = stored[gname]
        v = values(t, hf) if t.quantized else HFNamed(t, hf)
        if arch.rope_permute and gname.endswith((".attn_q.weight", ".attn_q.bias", ".attn_k.weight", ".attn_k.bias")):
            n = cfg["num_attention_heads"] if ".attn_q." in gname else cfg["num_key_value_heads"]
            v = HeadRowsUnpermuted(v, n, hf)
        if arch.norm_shift and gname.endswith("norm.weight"):  # Gemma's norms: the converter added the shift
            v = NormUnshifted(v, arch.norm_shift, hf)
        return v

    r = Readback(header.path, header, stored, cfg, names, value, notes)
    arch.read_config(r)
    tensors, consumed, anchors = {}, {}, {}
    for gname in stored:
        if gname in r.into_config:
            consumed[gname] = r.into_config[gname]
            continue
        if gname in DROPPED:
            consumed[gname] = DROPPED[gname]
            notes.append(f"{gname}: left out ({DROPPED[gname]}); config.json has no rope_scaling for it: copy "
                         "rope_scaling from the original model's config.json")
            continue
        made = arch.read_tensor(r, gname)
        for hf, v in made:
            tensors[hf] = v
        consumed[gname] = f"GGUF name of {', '.join(hf for hf, _ in made)}"
        if len(made) == 1 and arch.in_place(gname):
            anchors[gname] = made[0][0]  # one HF tensor in its place: what --keep-format and llama-quantize map back
    _check_complete(header, stored, cfg["num_hidden_layers"], lambda suffix: arch.blocks_with(r, suffix))
    quantized = any(t.quantized for t in stored.values())
    return Decoded(f"GGUF {arch.arch} LLM ({summary})", tensors, consumed,
                   dequantized=quantized, notes=notes, anchors=anchors, config=cfg)
