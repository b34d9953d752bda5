"""The GGUF output types of `--to gguf-*`, named as llama.cpp's `llama-quantize` names them, and ComfyUI-GGUF's rule
for image models.

A *mix* is what `llama-quantize` calls a file type (`Q4_K_M`): a default GGML type for the quantizable tensors, and
rules that give some tensors another type (attention V and FFN down projections get more bits in `_M` and `_L`
mixes). The rules differ by kind of model:

- LLMs: llama.cpp's `llama_tensor_get_type` (`ckpt.families.llm.quant_mix`);
- diffusion models: ComfyUI-GGUF's `img_tensor_get_type` (its `tools/lcpp.patch`, the patched llama.cpp its users
  build to make K-quant files), below as data: `IMAGE_BUMPS`. Its patch refuses the IQ types for image models;
  so does ckpt. A K-type tensor whose rows are not a multiple of 256 falls back to F16 there (not to a legacy
  type as llama.cpp's LLM rule does). Reference: ComfyUI-GGUF main at 795e451 (Dec 2025), the version that knows
  every image architecture ckpt writes (the older df6f1ab patch knew only flux, sd1 and sdxl; its bumps are the
  same for those).

`--pure` is `llama-quantize --pure`: every quantizable tensor in the default type, the row-length fallbacks aside.
ComfyUI-GGUF's patch ignores --pure for image models; ckpt applies it to them too (what the flag says).

This module is torch-free: the `--to` registry reads it for the CLI's choices.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mix:
    """One `--to gguf-<name>`."""

    name: str  # llama-quantize's name in lower case: "q4_k_m"
    ftype: str  # its gguf.LlamaFileType member (general.file_type)
    default: str  # the GGML type of the quantizable tensors, before the mix's rules
    image: bool = True  # ComfyUI-GGUF quantizes image models with it (its patch refuses the IQ types)

    @property
    def label(self) -> str:
        """llama.cpp's spelling, for file names (`model-Q4_K_M.gguf`)."""
        return self.name.upper()

    @property
    def quantized(self) -> bool:
        return self.default not in PLAIN


PLAIN = ("F32", "F16", "BF16")

MIXES = (
    Mix("q8_0", "MOSTLY_Q8_0", "Q8_0"),
    Mix("q6_k", "MOSTLY_Q6_K", "Q6_K"),
    Mix("q5_k_m", "MOSTLY_Q5_K_M", "Q5_K"),
    Mix("q5_k_s", "MOSTLY_Q5_K_S", "Q5_K"),
    Mix("q4_k_m", "MOSTLY_Q4_K_M", "Q4_K"),
    Mix("q4_k_s", "MOSTLY_Q4_K_S", "Q4_K"),
    Mix("q3_k_l", "MOSTLY_Q3_K_L", "Q3_K"),
    Mix("q3_k_m", "MOSTLY_Q3_K_M", "Q3_K"),
    Mix("q3_k_s", "MOSTLY_Q3_K_S", "Q3_K"),
    Mix("q2_k", "MOSTLY_Q2_K", "Q2_K"),
    Mix("iq4_xs", "MOSTLY_IQ4_XS", "IQ4_XS", image=False),
    Mix("iq4_nl", "MOSTLY_IQ4_NL", "IQ4_NL", image=False),
    Mix("q5_1", "MOSTLY_Q5_1", "Q5_1"),
    Mix("q5_0", "MOSTLY_Q5_0", "Q5_0"),
    Mix("q4_1", "MOSTLY_Q4_1", "Q4_1"),
    Mix("q4_0", "MOSTLY_Q4_0", "Q4_0"),
    Mix("bf16", "MOSTLY_BF16", "BF16"),
    Mix("f16", "MOSTLY_F16", "F16"),
    Mix("f32", "ALL_F32", "F32"),
)

# llama-quantize's aliases: the name without a size letter is the _M mix
ALIASES = {"q5_k": "q5_k_m", "q4_k": "q4_k_m", "q3_k": "q3_k_m"}

K_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def mix(name: str) -> Mix:
    """The mix of a name or alias (`q4_k` -> `q4_k_m`)."""
    name = ALIASES.get(name, name)
    return next(m for m in MIXES if m.name == name)


@dataclass(frozen=True)
class Bump:
    """One rule of ComfyUI-GGUF's `img_tensor_get_type` (the first that matches applies): tensors whose name
    contains one of `names` (all of the strings of a tuple entry) get `types[ftype]`; the tensors of a rule are
    numbered (`ImageMix`), and a type may depend on that number (`first`: (n, type below n, type from n))."""

    what: str
    names: tuple
    types: dict
    first: dict | None = None  # ftype -> (n, type below n, type from n)


IMAGE_BUMPS = (
    Bump("attention V", ("attn_v.weight", ".to_v.weight", ".v.weight", ".attn.w1v.weight", ".attn.w2v.weight",
                         "_attn.v_proj.weight"),
         {"MOSTLY_Q2_K": "Q3_K", "MOSTLY_Q3_K_L": "Q5_K", "MOSTLY_Q4_K_M": "Q6_K", "MOSTLY_Q5_K_M": "Q6_K"},
         first={"MOSTLY_Q3_K_M": (2, "Q5_K", "Q4_K"), "MOSTLY_Q4_K_S": (4, "Q5_K", None)}),
    Bump("fused QKV", ("attn_qkv.weight", "attn.qkv.weight", "attention.qkv.weight"),
         {"MOSTLY_Q3_K_M": "Q4_K", "MOSTLY_Q3_K_L": "Q4_K", "MOSTLY_Q4_K_M": "Q5_K", "MOSTLY_Q5_K_M": "Q6_K"}),
    Bump("FFN down", ("ffn_down", ("experts.", ".w2.weight"), ".ffn.2.weight", ".ff.net.2.weight",
                      ".mlp.layer2.weight", ".adaln_modulation_mlp.2.weight", ".feed_forward.w2.weight"),
         {"MOSTLY_Q3_K_M": "Q4_K", "MOSTLY_Q3_K_L": "Q5_K", "MOSTLY_Q4_K_S": "Q5_K", "MOSTLY_Q4_K_M": "Q6_K",
          "MOSTLY_Q5_K_M": "Q6_K", "MOSTLY_Q4_0": "Q4_1", "MOSTLY_Q5_0": "Q5_1"}),
)

# llama.cpp's quantize loop leaves these alone whatever the model (tensor_allows_quantization's name tests that
# can match an image model's names)
NEVER_QUANTIZED = ("_norm.weight", "ffn_gate_inp.weight", "attn_rel_b.weight")


def _hit(name: str, entry) -> bool:
    return all(s in name for s in entry) if isinstance(entry, tuple) else entry in name


def _bump_of(name: str):
    return next((b for b in IMAGE_BUMPS if any(_hit(name, e) for e in b.names)), None)


class ImageMix:
    """ComfyUI-GGUF's `img_tensor_get_type` for one output file. Its attention-V counter numbers the tensors in the
    order llama-quantize visits them: by name (llama.cpp keeps the weights in a map ordered by name; the `blk.N`
    layer sort of later versions does not apply to image names), so `names` are every tensor the mix will see."""

    def __init__(self, m: Mix, pure: bool = False, names=()):
        self.mix, self.pure = m, pure
        self.rank: dict[str, int] = {}
        seen: dict[str, int] = {}
        for n in sorted(names):
            b = _bump_of(n)
            if b is not None:
                self.rank[n] = seen.get(b.what, 0)
                seen[b.what] = self.rank[n] + 1

    def type_of(self, name: str, row_len: int) -> tuple[str, str, str | None]:
        """(GGML type name, why, the type it fell back from or None) for a quantizable tensor."""
        m, t, why = self.mix, self.mix.default, "quantized"
        b = _bump_of(name)
        if b is not None and not self.pure:
            bumped = b.types.get(m.ftype)
            if b.first and m.ftype in b.first:
                n, below, above = b.first[m.ftype]
                bumped = below if self.rank[name] < n else above
            if bumped is not None and bumped != t:
                t, why = bumped, f"{b.what}, more bits in {m.label}"
        if t in K_TYPES and row_len % 256:
            return "F16", f"{t} fallback: rows of {row_len} are not a multiple of 256", t
        return t, why, None
