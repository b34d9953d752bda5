"""`convert LLM --to ct-fp8-dynamic|ct-fp8-block|ct-w4a16|ct-w8a16|ct-nvfp4a16` (and `merge-lora ... --to ct-*`): a
Hugging Face LLM folder as the compressed-tensors checkpoint vLLM serves, what llm-compressor 0.14's data-free path
writes for the same weights (presets FP8_DYNAMIC, FP8_BLOCK, W4A16, W8A16, NVFP4A16 with `targets="Linear"`,
`ignore=["lm_head"]`): the Linear weights' tensors byte for byte (`ckpt.quant.ct_encode`), every other tensor as it
is (in its natural dtype: a decoded FP8/GPTQ/GGUF input is written as the plain model the encoders quantize), and
config.json's `quantization_config` as llm-compressor fills it in (the same dict; its `version` names the
compressed-tensors release whose layout is written, 0.19.0).

Which weights are a Linear's (the checkpoint has no module classes; these are what `oneshot` quantizes on the model
and `model_free_ptq` on every Linear): 2-D floating `X.weight` whose module X is not a norm (`*norm`, as
`match_quantizable_tensors` skips them), not an embedding (`embed` in the name, GPT-style `wte`/`wpe`: model_free_ptq
would quantize those too, but they are no Linear, and transformers would not load them) and not a MoE router (`...
.gate` / `.router` beside experts: not a Linear in transformers 5, and kept plain in llm-compressor's MoE recipes).
`lm_head` (the preset's default ignore) and every weight `--keep PATTERN` matches (tensor or module name, fnmatch)
stay plain; the kept Linear modules are listed by name in `ignore`, so a loader does not expect them quantized.

NVFP4: llm-compressor gives a layer's attention q/k/v weights one global scale, and its MLP gate/up (Mixtral's
w1/w3) another (`FusionHandler` over `DEFAULT_FUSED_MAPPINGS`: vLLM fuses those matrices and the fused kernel has one
global scale); the amax of each set is read once, before its first weight is written.

Refused before anything is written: an input that is no LLM folder (no config.json naming a causal LM, nor an
LLM GGUF), a weight whose input width the group (W4A16/W8A16: --group-size, else 128) or NVFP4's 16 does not divide
(llm-compressor raises there too), --layout, --format torch.
"""

from __future__ import annotations

import fnmatch
import re

from ckpt.dtypes import is_float
from ckpt.errors import CkptError
from ckpt.io.plan import OutTensor, Plan
from ckpt.io.tensors import Tensor
from ckpt.targets.planners.kept import kept
from ckpt.report import Report, plural

CT_VERSION = "0.19.0"  # the compressed-tensors release llm-compressor 0.14 pins: the layout written
DEFAULT_IGNORE = "lm_head"
_ROUTER = re.compile(r"\.(mlp|block_sparse_moe|feed_forward|moe)\.(gate|router)$")
_EMBED = re.compile(r"(^|\.)(wte|wpe|shared)$")
# llm-compressor's fused sets (microscale.DEFAULT_FUSED_MAPPINGS): the prefix a set shares, and its member
_FUSED = (re.compile(r"^(?P<p>.*(attn|attention)\.)(q_proj|k_proj|v_proj)\.weight$"),
          re.compile(r"^(?P<p>.*(attn|attention)\.)(wq_a|wkv_a_with_mqa)\.weight$"),
          re.compile(r"^(?P<p>.*mlp\.)(gate_proj|up_proj)\.weight$"),
          re.compile(r"^(?P<p>.*)(w1|w3)\.weight$"))


def _args(num_bits, type_, strategy, *, dynamic=False, group_size=None, block=None, scale_dtype=None) -> dict:
    """One `QuantizationArgs` as llm-compressor's config.json dumps it."""
    return {"actorder": None, "block_structure": block, "dynamic": dynamic, "group_size": group_size,
            "num_bits": num_bits, "observer": None, "observer_kwargs": {}, "scale_dtype": scale_dtype,
            "strategy": strategy, "symmetric": True, "type": type_, "zp_dtype": None}


class Preset:
    """One llm-compressor preset scheme: its name, the stored format, how a weight is encoded."""

    def __init__(self, scheme: str, kind: str, fmt: str, bits: int = 8, group: int | None = None):
        self.scheme, self.kind, self.format, self.bits, self.group = scheme, kind, fmt, bits, group

    def group_config(self, group: int | None) -> dict:
        k = self.kind
        if k == "fp8_channel":
            w = _args(8, "float", "channel")
            a = _args(8, "float", "token", dynamic=True)
        elif k == "fp8_block":
            w = _args(8, "float", "block", block=[128, 128])
            a = _args(8, "float", "group", dynamic=True, group_size=128)
        elif k == "int":
            w, a = _args(self.bits, "int", "group", group_size=group), None
        else:
            w, a = _args(4, "float", "tensor_group", group_size=16, scale_dtype="torch.float8_e4m3fn"), None
        return {"format": self.format, "input_activations": a, "output_activations": None, "targets": ["Linear"],
                "weights": w}

    def config(self, group: int | None, ignore: list[str]) -> dict:
        return {"version": CT_VERSION, "quant_method": "compressed-tensors", "transform_config": {},
                "config_groups": {self.scheme: self.group_config(group)}, "format": self.format,
                "global_compression_ratio": None, "ignore": ignore, "kv_cache_scheme": None,
                "quantization_status": "compressed"}


PRESETS = {
    "ct-fp8-dynamic": Preset("FP8_DYNAMIC", "fp8_channel", "float-quantized"),
    "ct-fp8-block": Preset("FP8_BLOCK", "fp8_block", "float-quantized"),
    "ct-w4a16": Preset("W4A16", "int", "pack-quantized", 4, 128),
    "ct-w8a16": Preset("W8A16", "int", "pack-quantized", 8, 128),
    "ct-nvfp4a16": Preset("NVFP4A16", "nvfp4", "nvfp4-pack-quantized", 4, 16),
}


def is_llm(ckpt, views) -> bool:
    """An HF causal-LM folder with its config.json, or an LLM GGUF (whose view brings a config)."""
    from ckpt.targets.planners.gguf_llm_out import applies

    return applies(ckpt, views) and (ckpt.components[0].config is not None or views[0].config is not None)


def _matches(pats: list[str], *names: str) -> bool:
    return any(fnmatch.fnmatchcase(n, p) for p in pats for n in names)


def linear_module(t: Tensor) -> str | None:
    """The module name of a Linear's weight (module docstring), else None."""
    name = t.name
    if not (name.endswith(".weight") and len(t.shape) == 2 and is_float(t.dtype) and t.numel > 0):
        return None
    module = name[: -len(".weight")]
    if module.endswith("norm") or "embed" in module.lower() or _EMBED.search(module) or _ROUTER.search(module):
        return None
    return module


def fused_prefix(name: str) -> str | None:
    for i, rx in enumerate(_FUSED):
        m = rx.match(name)
        if m:
            return f"{i}:{m.group('p')}"
    return None


def ct_outputs(target_name: str, group: int | None, report: Report, keep: list[str], views):
    """(make, finish) for the planners: `make(tensor)` the quantized keys of a Linear weight, the tensor itself
    otherwise; `finish(plan)` puts the quantization_config into config.json and says what was done."""
    from ckpt.quant import ct_encode

    preset = PRESETS[target_name]
    group = group or preset.group
    casters: dict = {}
    quantized: list[str] = []
    ignored: list[str] = []
    tensors = [t for v in views for t in v.tensors.values()]
    # NVFP4's shared global scales: the quantized members of each fused set, one amax for them all
    shared: dict[str, object] = {}
    if preset.kind == "nvfp4":
        sets: dict[str, list[Tensor]] = {}
        for t in tensors:
            module = linear_module(t)
            if module is not None and module != DEFAULT_IGNORE and not _matches(keep, t.name, module):
                p = fused_prefix(t.name)
                if p is not None:
                    sets.setdefault(p, []).append(t)
        for members in sets.values():
            amax = _SharedAmax(members)
            for t in members:
                shared[t.name] = amax

    def make(t: Tensor) -> list[OutTensor]:
        module = linear_module(t)
        if module is not None and (module == DEFAULT_IGNORE or _matches(keep, t.name, module)):
            if module != DEFAULT_IGNORE:
                ignored.append(module)
            module = None
        if module is not None:
            k = t.shape[1]
            need = group if preset.kind in ("int", "nvfp4") else None
            if need and k % need:
                raise CkptError(f"{t.name}: {k} inputs are not a multiple of the {preset.scheme} group size {need} "
                                + ("(choose another --group-size, or --keep it)" if preset.kind == "int"
                                   else "(--keep it)") + "; nothing was written")
            quantized.append(t.name)
            if preset.kind == "fp8_channel":
                return ct_encode.fp8_channel(t, module, report)
            if preset.kind == "fp8_block":
                return ct_encode.fp8_block(t, module, report)
            if preset.kind == "int":
                return ct_encode.int_group(t, module, preset.bits, group, report)
            return ct_encode.nvfp4(t, module, report, shared.get(t.name))
        return [kept(t, casters, report)]

    def finish(plan: Plan) -> None:
        if not quantized:
            raise CkptError(f"--to {target_name}: no Linear weight to quantize (every one is kept); nothing was written")
        qc = preset.config(group, [DEFAULT_IGNORE] + sorted(set(ignored)))
        _put_config(plan, qc)
        plan.notes.append(f"{plural(len(quantized), 'Linear weight')} stored as compressed-tensors {preset.scheme}"
                          + (f" (group {group})" if preset.kind == "int" else "")
                          + f"; {DEFAULT_IGNORE}, embeddings, norms"
                          + (f", {plural(len(set(ignored)), 'module')} --keep matched" if ignored else "")
                          + " and other tensors kept as they are")

    return make, finish


class _SharedAmax:
    """The finite amax of several weights (a fused set), computed once on first use (one streamed pass each)."""

    def __init__(self, members: list[Tensor]):
        self.members, self._v = members, None

    def __call__(self):
        if self._v is None:
            from ckpt.lazy import torch
            from ckpt.quant.comfy_quant import finite_amax

            # each member's amax in the model's dtype, as the observers hold them, then the largest
            self._v = torch.stack([finite_amax(t).to(t.natural_dtype).float() for t in self.members]).max()
        return self._v


def _put_config(plan: Plan, qc: dict) -> None:
    """config.json gets `quantization_config` (a generated one directly, a copied one by a composed edit)."""
    for rel, cfg in plan.generated.items():
        if rel.rpartition("/")[2] == "config.json" and isinstance(cfg, dict):
            cfg["quantization_config"] = qc
            return
    rel = next((r for r in plan.json_edits if r.rpartition("/")[2] == "config.json"), None)
    if rel is None:
        rel = next((str(r) for _, r in plan.copies if str(r).rpartition("/")[2] == "config.json"), "config.json")
    prev = plan.json_edits.get(rel)

    def edit(cfg: dict, prev=prev) -> dict:
        cfg = prev(cfg) if prev else cfg
        cfg.pop("_pre_quantization_dtype", None)
        cfg["quantization_config"] = qc
        return cfg

    plan.json_edits[rel] = edit
