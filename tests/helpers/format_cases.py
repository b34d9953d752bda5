"""One or more tiny checkpoints of every registered quantized format (`ckpt.quant.formats`), each with its oracle:
the cases the conformance test tests/test_quant_formats.py runs over every format, so that a new format cannot
land without one (it checks `set(CASES)` against the registry).

Each checkpoint is made by the format's own library (or, where none writes it, from the layout's definition:
the FP8 layouts of helpers/decoder_models.py, gpt-oss MXFP4's restated packer), and its oracle is that library's
own decoding (gguf's dequantize, bitsandbytes', comfy-kitchen's, optimum-quanto's, AutoGPTQ's, AutoAWQ's,
compressed-tensors', ModelOpt's, transformers' MXFP4 conversion, hqq's, torchao's), in the dtype the library gives.
The builders are the ones the per-format tests use (helpers/gptq_base.py, awq_base, ct_ref, modelopt_base,
mxfp4_ref, hqq_base, torchao_ref, decoder_models, tests/gguf_helpers.py); tests/test_quant_llm_fuzz.py mutates
the LLM folders made here.

`CASES`: format name -> its case builders, each `builder(folder) -> Case` writing its checkpoint under `folder`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch

L = "model.layers.0.self_attn.q_proj"  # the first quantized Linear of the tiny Llamas


@dataclass
class Case:
    """One checkpoint of a format and what the conformance test expects of it.

    - `path`: the checkpoint (a folder, or a single file);
    - `oracle`: decoded name -> the format's library's values, in the dtype the library gives them;
    - `drop`, `refusal`: a stored key the logical view consumes (a scale, a zero point, a code table ...) and what
      ckpt's one-line refusal of the checkpoint without it says; `refusal` None where the format documents the key
      as optional (`optional` says why): the checkpoint without it decodes to the oracle all the same. A format
      that consumes nothing (GGUF blocks carry their scales) has `drop` "" and breaks its file in `without`;
    - `without(path, key)`: removes `key` from the checkpoint at `path` (None: from its safetensors file);
    - `bands`: decoded tensors read in row bands and compared with one whole read;
    - `llm`: an HF LLM folder, whose dequantized output transformers loads strictly; `to_casts_oracle`: ckpt decodes
      it in the library's dtype, so `convert --to` any other dtype gives the oracle's values cast once (False where
      ckpt rounds its exact float32 products once to the target instead: compressed-tensors, ModelOpt);
    - `dequant_to`: the `dequant --to` that gives the oracle's dtype, where ckpt's default (the model's dtype before
      quantization) is not the dtype the oracle decodes to;
    """

    path: Path
    oracle: dict[str, torch.Tensor]
    drop: str
    refusal: str | None
    bands: tuple[str, ...]
    optional: str = ""
    without: Callable[[Path, str], None] | None = None
    llm: bool = False
    to_casts_oracle: bool = False
    dequant_to: str | None = None


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Same dtype, shape and bits; NaN == NaN whatever its payload, +0 == -0 (bitsandbytes' CPU paths differ
    there), as tests/test_decoder_fuzz.py compares."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    g, w = got.float() + 0.0, want.float() + 0.0
    both_nan = torch.isnan(g) & torch.isnan(w)
    g, w = torch.where(both_nan, 0.0, g), torch.where(both_nan, 0.0, w)
    return bool(torch.equal(g.view(torch.int32), w.view(torch.int32)))


def _cuts(rows: int, align: int) -> list[int]:
    """Band edges inside (0, rows): uneven where any row may start a band, on multiples of `align` otherwise."""
    picks = (1, 3, rows // 3, rows // 2 + 1, rows - 1) if align == 1 else range(align, rows, align)
    return sorted({c - c % align for c in picks if 0 < c - c % align < rows})


def assert_bands_equal_the_whole(path, names) -> None:
    """Each decoded tensor of `names` in the checkpoint at `path`, read in several row bands (as the writer reads
    it, `Tensor.read(a, b, device)`), equals the same rows of one whole read. The conformance test runs it on every
    case; a format's variant matrix runs it on each variant where bands take other code paths."""
    from ckpt.io.checkpoint import open_checkpoint
    from ckpt.quant.view import logical_view

    cpu = torch.device("cpu")
    with open_checkpoint(str(path)) as ck:
        (component,) = ck.components
        view = logical_view(component)
        for name in names:
            t = view.tensors[name]
            assert t.row_align is not None, f"{name} is read whole: no bands to compare"
            rows = t.shape[0]
            whole = t.read(0, rows, cpu)
            edges = [0, *_cuts(rows, t.row_align), rows]
            assert len(edges) > 2, (name, rows, t.row_align)
            for a, b in zip(edges, edges[1:]):
                assert same(t.read(a, b, cpu), whole[a:b].contiguous()), (name, a, b)


# ---------------------------------------------------------------------------------------------------
# GGUF: gguf's own writer, quantizers and dequantize


def gguf_values(path) -> dict[str, torch.Tensor]:
    """gguf's reader and dequantize on the file: {name: float32 values in torch order and shape}."""
    import gguf

    out = {}
    for t in gguf.GGUFReader(path).tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        out[t.name] = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype("float32").reshape(shape))
    return out


def _gguf_blocks_tensors():
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from gguf_helpers import quantized

    rng = np.random.default_rng(0)
    tensors = {}
    for name, t in (("double_blocks.0.img_attn.qkv.weight", T.Q4_0), ("double_blocks.0.img_mlp.0.weight", T.Q5_1),
                    ("double_blocks.0.img_mlp.2.weight", T.Q8_0), ("final_layer.linear.weight", T.MXFP4)):
        tensors[name] = (quantized(rng.standard_normal((48, 64)).astype(np.float32), t)[0], t)
    tensors["final_layer.norm.weight"] = rng.standard_normal(64).astype(np.float32)
    return tensors


def gguf_blocks(folder: Path) -> Case:
    """A ComfyUI-GGUF style diffusion GGUF (Q4_0, Q5_1, Q8_0, MXFP4 blocks, an F32 norm), written by gguf's
    GGUFWriter from gguf.quants' blocks. Nothing is consumed (each block carries its scales), so the refusal is
    a file cut short."""
    from gguf_helpers import write_gguf

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.gguf"
    write_gguf(path, "flux", _gguf_blocks_tensors())

    def truncate(path: Path, _key: str) -> None:
        path.write_bytes(path.read_bytes()[:-100])

    return Case(path, gguf_values(path), drop="", refusal="truncated or corrupt",
                bands=("double_blocks.0.img_attn.qkv.weight", "final_layer.linear.weight"), dequant_to="fp32",
                without=truncate)


def _qwen2_gguf(path: Path, skip=()) -> dict[str, torch.Tensor]:
    """llama.cpp's conversion of a tiny Qwen2 (Q8_0 matrices, F32 vectors), less the GGUF tensors in `skip`;
    returns {HF name: gguf's values}."""
    import gguf
    from gguf import GGMLQuantizationType as T
    from gguf_helpers import ARCH_ENUM, hf_to_gguf
    from helpers.llm import tiny

    model = tiny("qwen2")
    table = gguf.get_tensor_name_map(ARCH_ENUM["qwen2"], model.config.num_hidden_layers)
    names = {}
    for hf in model.state_dict():
        base, suffix = hf.rsplit(".", 1)
        names[table.get_name(base) + "." + suffix] = hf

    class Without:  # the model as hf_to_gguf reads it, less the tensors in `skip`
        config = model.config

        def state_dict(self):
            return {k: v for k, v in model.state_dict().items() if k not in {names[g] for g in skip}}

    stored = hf_to_gguf(Without(), "qwen2", path, qtype=T.Q8_0)
    values = gguf_values(path)
    assert set(values) == set(stored)
    return {names[g]: v for g, v in values.items()}


def gguf_llm(folder: Path) -> Case:
    """A llama.cpp LLM GGUF (a tiny Qwen2 in Q8_0): decoded to the HF folder transformers loads; the stored GGUF
    names are consumed for the HF ones."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.gguf"
    oracle = _qwen2_gguf(path)

    def without(path: Path, key: str) -> None:
        _qwen2_gguf(path, skip={key})

    return Case(path, oracle, drop="blk.0.attn_k.weight", refusal="attn_k", without=without, llm=True,
                to_casts_oracle=True, dequant_to="fp32",
                bands=("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"))


# ---------------------------------------------------------------------------------------------------
# single-file formats: helpers/decoder_models.py (bitsandbytes, comfy-kitchen, the FP8 layouts, optimum-quanto)


def _from_model(folder: Path, m, drop: str, refusal: str | None, optional: str = "", to: str | None = "fp32") -> Case:
    """A decoder_models checkpoint as test_decoder_fuzz writes it. Its oracle gives float32 values, but
    optimum-quanto's gives its module's dtype (`to` None: what ckpt's dequant writes by default too)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in m.sd.items()}, folder / "model.safetensors", metadata=m.metadata)
    if m.config is not None:
        (folder / "config.json").write_text(json.dumps(m.config))
    path = folder if m.config is not None else folder / "model.safetensors"
    return Case(path, m.oracle(m.sd), drop=drop, refusal=refusal, bands=tuple(m.weights), optional=optional,
                dequant_to=to)


def bnb_nf4_nested(folder: Path) -> Case:
    from helpers import decoder_models as dm

    return _from_model(folder, dm.bnb_4bit("nf4", True), "m.weight.absmax",
                       "needs 24 absmax values in 'm.weight.absmax'")


def bnb_int8(folder: Path) -> Case:
    from helpers import decoder_models as dm

    return _from_model(folder, dm.bnb_int8(), "m.weight_format", None,
                       "the layout marker: row-major is the only layout a saved LLM.int8 weight has")


def comfy_nvfp4(folder: Path) -> Case:
    from helpers import decoder_models as dm

    return _from_model(folder, dm.comfy("nvfp4", shape=(256, 64)), "m.weight_scale",
                       "has no block scales 'm.weight_scale'")


def comfy_mxfp8(folder: Path) -> Case:
    from helpers import decoder_models as dm

    return _from_model(folder, dm.comfy("mxfp8", shape=(256, 64)), "m.weight_scale",
                       "has no block scales 'm.weight_scale'")


def comfy_svdquant(folder: Path) -> Case:
    """A ComfyUI SVDQuant W4A4 layer (comfy-kitchen's layout, `state_dict_tensors`), its oracle comfy-kitchen's
    dequantize in fp32. ckpt's decode agrees with it within fp32 rounding in general (tests/test_svdquant.py); here
    every product and sum is exact (power-of-two smoothing, few-bit scales and factors), so bit for bit."""
    pytest.importorskip("comfy_kitchen.tensor")
    from comfy_kitchen.backends.eager.svdquant import _pack_int4_row_major
    from comfy_kitchen.tensor import QuantizedTensor, TensorCoreSVDQuantW4A4Layout as Layout
    from helpers.comfy_ref import conf_tensor

    g = torch.Generator().manual_seed(0)
    n, k, r, bf = 96, 128, 4, torch.bfloat16
    params = Layout.Params(scale=(torch.randint(1, 256, (k // 64, n), generator=g) / 1024).to(bf), orig_dtype=bf,
                           orig_shape=(n, k), proj_down=(torch.randint(-8, 9, (k, r), generator=g) / 16).to(bf),
                           proj_up=(torch.randint(-8, 9, (n, r), generator=g) / 16).to(bf),
                           smooth_factor=(2.0 ** torch.randint(-1, 2, (k,), generator=g)).to(bf))
    codes = _pack_int4_row_major(torch.randint(-8, 8, (n, k), generator=g))
    sd = {f"m.weight{s}": t for s, t in Layout.state_dict_tensors(codes, params).items()}
    sd |= {"m.comfy_quant": conf_tensor({"format": "svdquant_w4a4"}), "m.bias": torch.randn(n, generator=g).to(bf)}
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.safetensors"
    save_file(sd, path)
    fp32 = Layout.Params(**{f: getattr(params, f).float() for f in ("scale", "proj_down", "proj_up", "smooth_factor")},
                         orig_dtype=torch.float32, orig_shape=(n, k))
    oracle = {"m.weight": QuantizedTensor(codes, "TensorCoreSVDQuantW4A4Layout", fp32).dequantize()}
    return Case(path, oracle, drop="m.weight_proj_up", refusal="low-rank up projection of 'm.weight'",
                bands=("m.weight",), dequant_to="fp32")


def _convrot(folder: Path, fmt: str, drop: str, refusal: str) -> Case:
    """One ConvRot layer (ckpt.quant.convrot) made by comfy-kitchen's quantizer, with a bias; the oracle is
    comfy-kitchen's dequantize of the layer as ComfyUI's loader builds it (tests/test_convrot.py has the rest)."""
    ck = pytest.importorskip("comfy_kitchen.tensor")
    w = torch.randn((48, 256), generator=torch.Generator().manual_seed(31)) * 0.05
    if fmt == "int8_tensorwise":
        layout, q, p = ck.TensorWiseINT8Layout, *ck.TensorWiseINT8Layout.quantize(w, per_channel=True, convrot=True)
        saved, conf = {"": q, "_scale": p.scale}, {"format": fmt, "convrot": True, "convrot_groupsize": 256}
    else:
        layout = ck.TensorCoreConvRotW4A4Layout if fmt == "convrot_w4a4" else ck.AsymW4A8Int8Layout
        q, p = layout.quantize(w)
        saved = layout.state_dict_tensors(q, p)
        conf = {"format": fmt, "convrot_groupsize": 256} | ({"group_size": 16} if fmt == "asym_w4a8_int8" else {})
    sd = {f"m.weight{k}": v for k, v in saved.items()}
    sd["m.comfy_quant"] = torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)
    sd["m.bias"] = torch.randn(48, generator=torch.Generator().manual_seed(32))
    folder.mkdir(parents=True, exist_ok=True)
    save_path = folder / "model.safetensors"
    from safetensors.torch import save_file

    save_file(sd, save_path)
    oracle = {"m.weight": layout.dequantize(q, type(p)(**{**p.__dict__, "orig_dtype": torch.float32}))}
    return Case(save_path, oracle, drop=drop, refusal=refusal, bands=("m.weight",), dequant_to="fp32")


def convrot_int8(folder: Path) -> Case:
    return _convrot(folder, "int8_tensorwise", "m.weight_scale", "has no per-channel scale 'm.weight_scale'")


def convrot_w4a4(folder: Path) -> Case:
    return _convrot(folder, "convrot_w4a4", "m.weight_scale", "has no per-row scale 'm.weight_scale'")


def convrot_w4a8(folder: Path) -> Case:
    return _convrot(folder, "asym_w4a8_int8", "m.weight_s_channel", "has no channel scales 'm.weight_s_channel'")


def kohya_fp8(folder: Path) -> Case:
    from helpers import decoder_models as dm

    return _from_model(folder, dm.kohya(), "a.scale_weight", "has no scale")


def hf_block_fp8(folder: Path) -> Case:
    from helpers import decoder_models as dm

    return _from_model(folder, dm.hf_block(), "a.activation_scale", None,
                       "an activation scale: inference only, no part of the weight")


def comfy_int8_rowwise(folder: Path) -> Case:
    from helpers import decoder_models as dm

    return _from_model(folder, dm.comfy("int8_rowwise"), "m.weight_scale", "has no scale 'm.weight_scale'")


def quanto_qint4(folder: Path) -> Case:
    from helpers import decoder_models as dm

    return _from_model(folder, dm.quanto("qint4"), "lin.weight._shift", "has no 'lin.weight._shift'", to=None)


def quanto_qint8(folder: Path) -> Case:
    from helpers import decoder_models as dm

    return _from_model(folder, dm.quanto("qint8"), "lin.input_scale", None,
                       "optimum-quanto's activation scale: inference only, no part of the weight", to=None)


# ---------------------------------------------------------------------------------------------------
# the quantized LLM folders people download


def gptq_4bit(folder: Path) -> Case:
    """AutoGPTQ's pack, sequential groups (what the LLM fuzz test mutates)."""
    from helpers.gptq_base import build

    oracle, _ = build(folder, 4, 32, False, False)
    return Case(folder, oracle, drop=f"{L}.scales", refusal=f"'{L}.scales' is missing", llm=True,
                to_casts_oracle=True, bands=(f"{L}.weight", "model.layers.0.mlp.down_proj.weight"))


def gptq_act_order(folder: Path) -> Case:
    """AutoGPTQ's pack with act-order (`g_idx` permuted): the group index is consumed too."""
    from helpers.gptq_base import build

    oracle, _ = build(folder, 4, 32, True, False)
    return Case(folder, oracle, drop=f"{L}.g_idx", refusal="which desc_act (act-order) needs", llm=True,
                to_casts_oracle=True, bands=("model.layers.0.mlp.gate_proj.weight",))


def awq_gemm(folder: Path) -> Case:
    from helpers.awq_base import build

    expected = build(folder, "gemm", 32)
    return Case(folder, {k: oracle for k, (oracle, _) in expected.items()}, drop=f"{L}.qzeros",
                refusal=f"'{L}.qzeros' is missing", llm=True, to_casts_oracle=True,
                bands=("model.layers.0.mlp.up_proj.weight",))


def awq_gemv(folder: Path) -> Case:
    """AutoAWQ has no CPU dequantizer for GEMV: the oracle is the AWQ formula on from_linear's own codes."""
    from helpers.awq_base import build

    expected = build(folder, "gemv", 32)
    return Case(folder, {k: formula for k, (_, formula) in expected.items()}, drop=f"{L}.scales",
                refusal=f"'{L}.scales' is missing", llm=True, to_casts_oracle=True,
                bands=("model.layers.0.mlp.up_proj.weight",))


def _ct(folder: Path, groups, ignore, drop: str, refusal: str, bands) -> Case:
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed (the oracle)")
    pytest.importorskip("loguru")
    from helpers import ct_ref

    schemes = ct_ref.build(folder, groups, ignore=ignore)
    return Case(folder, ct_ref.oracle(folder, schemes), drop=drop, refusal=refusal, llm=True, bands=bands)


def ct_int4(folder: Path) -> Case:
    from helpers import ct_ref

    return _ct(folder, {"g": ct_ref.linear(ct_ref.int_args(4, "group", 32, False))}, ["lm_head"],
               f"{L}.weight_zero_point", f"zero point '{L}.weight_zero_point' is missing", (f"{L}.weight",))


def ct_nvfp4(folder: Path) -> Case:
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed (the oracle)")
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4A16

    return _ct(folder, {"g": QuantizationScheme(targets=["Linear"], **NVFP4A16)}, ["lm_head"],
               f"{L}.weight_global_scale", f"global scale '{L}.weight_global_scale' is missing",
               ("model.layers.1.mlp.up_proj.weight",))


def ct_mixed(folder: Path) -> Case:
    """A mixed-precision config (int8 channel, NVFP4, int4 group; an ignore list): both weight classes."""
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed (the oracle)")
    from helpers import ct_ref

    mixed, ignore = ct_ref.mixed()
    return _ct(folder, mixed, ignore, f"{L}.weight_scale", f"weight_scale '{L}.weight_scale' is missing",
               (f"{L}.weight", "model.layers.0.mlp.up_proj.weight", "model.layers.0.self_attn.v_proj.weight"))


def modelopt_nvfp4(folder: Path) -> Case:
    from helpers.modelopt_base import build

    oracle = build(folder, in_config=True)
    return Case(folder, oracle, drop=f"{L}.weight_scale", refusal=f"block scales '{L}.weight_scale' is missing",
                llm=True, bands=(f"{L}.weight", "model.layers.0.mlp.down_proj.weight"))


def mxfp4_gptoss(folder: Path) -> Case:
    """Expert banks decoded along the experts; the oracle is transformers' `convert_moe_packed_tensors` (bf16),
    and every other tensor is stored plain."""
    pytest.importorskip("transformers")
    convert = pytest.importorskip("transformers.integrations.mxfp4").convert_moe_packed_tensors
    from helpers import mxfp4_ref

    packs, _ = mxfp4_ref.build(folder)
    stem = "model.layers.0.mlp.experts.gate_up_proj"
    return Case(folder, {s: convert(b, sc) for s, (b, sc) in packs.items()}, drop=f"{stem}_scales",
                refusal=f"'{stem}_scales' is missing", llm=True, to_casts_oracle=True,
                bands=(stem, "model.layers.1.mlp.experts.down_proj"))


def hqq_4bit(folder: Path) -> Case:
    from helpers.hqq_base import build

    oracle = build(folder)
    return Case(folder, oracle, drop=f"{L}.zero", refusal=f"'{L}.zero' is missing", llm=True, to_casts_oracle=True,
                bands=("model.layers.0.mlp.up_proj.weight", f"{L}.weight"))


def torchao_int4(folder: Path) -> Case:
    """transformers' TorchAoConfig save (IntxWeightOnlyConfig int4, asymmetric groups of 32), made and
    dequantized by torchao in a subprocess (helpers/torchao_ref.py); skips where torchao cannot be installed."""
    from helpers import torchao_ref

    try:
        torchao_ref.folder()
    except torchao_ref.Unavailable as e:
        pytest.skip(str(e))
    ref, _ = torchao_ref.build(folder, "IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32), "
                                       "mapping_type=MappingType.ASYMMETRIC)", "bfloat16")
    return Case(folder / "q", ref, drop=f"{L}._weight_scale", refusal=f"'{L}._weight_scale' is missing", llm=True,
                to_casts_oracle=True, bands=("model.layers.0.mlp.up_proj.weight",))


def mlx_affine(folder: Path) -> Case:
    """An MLX folder as mlx_lm.convert -q writes it (4-bit group 32, down_proj 8-bit by a per-layer entry); the oracle
    is mx.dequantize as helpers/mlx_ref.py restates it (held to mlx itself by tests/serve/test_mlx.py)."""
    from helpers import mlx_ref

    down = "model.layers.0.mlp.down_proj"
    oracle = mlx_ref.build(folder, 4, 32, overrides={down: {"bits": 8, "group_size": 32}})
    return Case(folder, oracle, drop=f"{L}.biases", refusal=f"MLX biases '{L}.biases' of uint32 codes", llm=True,
                to_casts_oracle=True, bands=(f"{L}.weight", f"{down}.weight"))


# Builders that take more than a few seconds (torchao runs in a subprocess): their cases are marked slow.
SLOW = {torchao_int4}

CASES: dict[str, list[Callable[[Path], Case]]] = {
    "gguf": [gguf_blocks, gguf_llm],
    "torchao": [torchao_int4],
    "comfy_quant": [comfy_nvfp4, comfy_mxfp8],
    "svdquant": [comfy_svdquant],
    "bitsandbytes": [bnb_nf4_nested, bnb_int8],
    "compressed-tensors": [ct_int4, ct_nvfp4, ct_mixed],
    "modelopt": [modelopt_nvfp4],
    "fp8": [kohya_fp8, hf_block_fp8, comfy_int8_rowwise],
    "quanto": [quanto_qint4, quanto_qint8],
    "gptq": [gptq_4bit, gptq_act_order],
    "awq": [awq_gemm, awq_gemv],
    "mxfp4": [mxfp4_gptoss],
    "hqq": [hqq_4bit],
    "convrot": [convrot_int8, convrot_w4a4, convrot_w4a8],
    "mlx": [mlx_affine],
}
