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
ComfyUI-GGUF's patch ignores --pure for image models; ckpt applies it to them too (what the flag says). So with
`--tensor-type PATTERN=TYPE` (llama.cpp's meaning: the first pattern found in a name gives the type, instead of
the mix's rules; the patch's llama.cpp predates the flag), and with the importance-matrix rule: a type llama-quantize
makes only with an importance matrix (`quant_mix.requires_imatrix`: Q2_K in a Q2_K_S file, or IQ2_XXS... by
--tensor-type) is refused without --imatrix, as the patch's llama.cpp refused it for every model.

Which mixes image models get (`Mix.image`): the patch refuses every IQ file type ("Invalid quantization type for
image model"), not Q2_K_S, TQ1_0 or TQ2_0. MXFP4_MOE, Q1_0 and Q2_0 are newer than the patch's llama.cpp (b3962), so
its tool cannot make them, and ComfyUI-GGUF's loader cannot read Q1_0 or Q2_0 (gguf-py 0.19 has no dequantizer for
them) nor has a use for MXFP4_MOE's experts rule: ckpt refuses the three for image models as well.

This module is torch-free: the `--to` registry reads it for the CLI's choices.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckpt.errors import CkptError


@dataclass(frozen=True)
class Mix:
    """One `--to gguf-<name>`."""

    name: str  # llama-quantize's name in lower case: "q4_k_m"
    ftype: str  # its llama_ftype name (gguf.LlamaFileType member; general.file_type)
    default: str  # the GGML type of the quantizable tensors, before the mix's rules (llama_ftype_get_default_type)
    image: bool = True  # ckpt quantizes image models with it (module docstring: ComfyUI-GGUF's patch)

    @property
    def file_type(self) -> int:
        """llama.h's number of the file type, written as general.file_type (gguf 0.19 lacks MOSTLY_Q2_0)."""
        from ckpt.families.llm.quant_mix import FILE_TYPE

        return FILE_TYPE[self.ftype]

    @property
    def not_for_images(self) -> str | None:
        """Why ckpt does not quantize image models with this mix (module docstring), or None."""
        if self.image:
            return None
        if self.name.startswith("iq"):
            return "ComfyUI-GGUF's llama.cpp patch refuses the IQ types for image models"
        return f"ComfyUI-GGUF's patched llama.cpp has no {self.label} (it is newer) and no rules for it"

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
    Mix("q2_k_s", "MOSTLY_Q2_K_S", "Q2_K"),
    Mix("iq4_xs", "MOSTLY_IQ4_XS", "IQ4_XS", image=False),
    Mix("iq4_nl", "MOSTLY_IQ4_NL", "IQ4_NL", image=False),
    Mix("iq3_m", "MOSTLY_IQ3_M", "IQ3_S", image=False),
    Mix("iq3_s", "MOSTLY_IQ3_S", "IQ3_S", image=False),
    Mix("iq3_xs", "MOSTLY_IQ3_XS", "IQ3_S", image=False),
    Mix("iq3_xxs", "MOSTLY_IQ3_XXS", "IQ3_XXS", image=False),
    Mix("iq2_m", "MOSTLY_IQ2_M", "IQ2_S", image=False),
    Mix("iq2_s", "MOSTLY_IQ2_S", "IQ2_XS", image=False),
    Mix("iq2_xs", "MOSTLY_IQ2_XS", "IQ2_XS", image=False),
    Mix("iq2_xxs", "MOSTLY_IQ2_XXS", "IQ2_XXS", image=False),
    Mix("iq1_m", "MOSTLY_IQ1_M", "IQ1_M", image=False),
    Mix("iq1_s", "MOSTLY_IQ1_S", "IQ1_S", image=False),
    Mix("tq2_0", "MOSTLY_TQ2_0", "TQ2_0"),
    Mix("tq1_0", "MOSTLY_TQ1_0", "TQ1_0"),
    Mix("mxfp4_moe", "MOSTLY_MXFP4_MOE", "MXFP4", image=False),
    Mix("q2_0", "MOSTLY_Q2_0", "Q2_0", image=False),
    Mix("q1_0", "MOSTLY_Q1_0", "Q1_0", image=False),
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
    """ComfyUI-GGUF's `img_tensor_get_type` for one output file, with llama-quantize's per-tensor flags where they
    apply. Its attention-V counter numbers the tensors in the order llama-quantize visits them: by name (llama.cpp
    keeps the weights in a map ordered by name; the `blk.N` layer sort of later versions does not apply to image
    names), so `names` are every tensor the mix will see.

    The flags in llama_tensor_get_type's order: `token_embedding_type` (token_embd.weight, per_layer_token_embd.weight)
    and `output_tensor_type` (output.weight) as given, then the first `tensor_types` pattern found in the name (a
    type instead of the bumps), else the bumps unless `pure`; then ComfyUI-GGUF's row-length fallback. No image
    model ckpt writes has the LLM names the first two and `quantize_output_tensor` (--leave-output-tensor, `leaves`)
    name; `unused` lists what applied to no tensor. `has_imatrix`: whether --imatrix is given (the image rules have
    no imatrix branch; a type that needs one is refused without it)."""

    def __init__(self, m: Mix, pure: bool = False, names=(), tensor_types=(), output_tensor_type=None,
                 token_embedding_type=None, quantize_output_tensor: bool = True, has_imatrix: bool = False):
        from ckpt.families.llm.tensor_type_option import compile_pattern, ggml_type

        self.mix, self.pure = m, pure
        self.patterns = [(p, compile_pattern(p), ggml_type(t, "--tensor-type")) for p, t in tensor_types]
        self.output_tensor_type = output_tensor_type and ggml_type(output_tensor_type, "--output-tensor-type")
        self.token_embedding_type = token_embedding_type and ggml_type(token_embedding_type,
                                                                       "--token-embedding-type")
        self.quantize_output_tensor, self.has_imatrix = quantize_output_tensor, has_imatrix
        self.used: set[str] = set()  # the flags (as `unused` names them) that gave a tensor its type
        self.rank: dict[str, int] = {}
        seen: dict[str, int] = {}
        for n in sorted(names):
            b = _bump_of(n)
            if b is not None:
                self.rank[n] = seen.get(b.what, 0)
                seen[b.what] = self.rank[n] + 1

    def leaves(self, name: str) -> bool:
        """--leave-output-tensor: output.weight keeps the type it has (llama.cpp's tensor_allows_quantization)."""
        return not self.quantize_output_tensor and name == "output.weight"

    def type_of(self, name: str, row_len: int) -> tuple[str, str, str | None]:
        """(GGML type name, why, the type it fell back from or None) for a quantizable tensor."""
        from ckpt.families.llm.quant_mix import BLOCK, TOKEN_EMBD_NAMES

        for flag, t, hit in (("--token-embedding-type", self.token_embedding_type, name in TOKEN_EMBD_NAMES),
                             ("--output-tensor-type", self.output_tensor_type, name == "output.weight")):
            if t and hit:
                if row_len % BLOCK[t]:
                    raise CkptError(f"{flag} {t}: tensor {name} has rows of {row_len} values, not whole {t} blocks "
                                    f"of {BLOCK[t]}")
                self.used.add(flag)
                return self._checked(name, t), flag, None
        m, t, why = self.mix, self.mix.default, "quantized"
        manual = next(((p, pt) for p, rx, pt in self.patterns if rx.search(name)), None)
        b = _bump_of(name)
        if manual is not None:
            t, why = manual[1], f"--tensor-type {manual[0]}={manual[1]}"
            self.used.add(why)
        elif b is not None and not self.pure:
            bumped = b.types.get(m.ftype)
            if b.first and m.ftype in b.first:
                n, below, above = b.first[m.ftype]
                bumped = below if self.rank[name] < n else above
            if bumped is not None and bumped != t:
                t, why = bumped, f"{b.what}, more bits in {m.label}"
        if t in K_TYPES and row_len % 256:
            return "F16", f"{t} fallback: rows of {row_len} are not a multiple of 256", t
        return self._checked(name, t), why, None

    def _checked(self, name: str, t: str) -> str:
        from ckpt.families.llm.quant_mix import GGML_REQUIRES_IMATRIX, requires_imatrix

        if not self.has_imatrix and (requires_imatrix(name, t, self.mix.ftype) or t in GGML_REQUIRES_IMATRIX):
            raise CkptError(f"{self.mix.label} needs an importance matrix: tensor {name} would be {t}, which "
                            "llama-quantize makes only with one; give --imatrix FILE")
        return t

    def unused(self) -> list[str]:
        """The flags that gave no tensor its type (after every `type_of`): "--tensor-type PATTERN=TYPE",
        "--output-tensor-type", "--token-embedding-type"; for a summary line (llama.cpp says nothing of them)."""
        out = [f"--tensor-type {p}={t}" for p, _, t in self.patterns if f"--tensor-type {p}={t}" not in self.used]
        out += [f for f, t in (("--output-tensor-type", self.output_tensor_type),
                               ("--token-embedding-type", self.token_embedding_type)) if t and f not in self.used]
        return out
