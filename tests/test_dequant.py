"""`ckpt dequant` against optimum-quanto itself: every weight must equal quanto's own `.dequantize()` bit
for bit, and the output must load into the plain model class with `strict=True`.

Models are tiny and quantized here with optimum-quanto (and diffusers `QuantoConfig`); bands are shrunk
so that multi-band reads (including packed 4/2-bit rows split across bit fields) are exercised.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

quanto = pytest.importorskip("optimum.quanto")
from optimum.quanto import freeze, qint4, qtypes, quantization_map, quantize  # noqa: E402

from helpers.quanto_ref import int_shift_weight, unpack_by_definition  # noqa: E402

QTYPES = ["qint8", "qfloat8_e4m3fn", "qfloat8_e5m2", "qfloat8_e4m3fnuz", "qint4", "qint2"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def small_bands(monkeypatch):
    """Bands of ~1000 elements: every tensor here spans several bands."""
    import ckpt.io.output

    monkeypatch.setattr(ckpt.io.output, "BAND_ELEMS", 1000)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)))


def small_model():
    """Linear with in > 128 (grouped for 4/2 bits) and bias; a 1-row Linear without bias (scale is per
    column there); a Conv2d; a Linear with in_features not a group size."""
    return torch.nn.Sequential(torch.nn.Linear(256, 32), torch.nn.Linear(20, 1, bias=False),
                               torch.nn.Conv2d(3, 16, 3), torch.nn.Linear(100, 48))


def quantized(model, qtype, dtype, seed=0):
    torch.manual_seed(seed)
    m = model().to(dtype)
    quantize(m, weights=qtypes[qtype])
    freeze(m)
    return m


def save_quanto_folder(m, folder, qmap=True):
    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, folder / "model.safetensors")
    if qmap:
        (folder / "quanto_qmap.json").write_text(json.dumps(quantization_map(m)))


def assert_matches_quanto(qmodel, got: dict, names):
    for name in names:
        want = qmodel.get_submodule(name).weight.dequantize()
        assert bits_equal(got[f"{name}.weight"], want), name


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
def test_every_qtype_and_dtype_matches_quanto(tmp_path, run_ckpt, qtype, dtype):
    m = quantized(small_model, qtype, dtype)
    src = tmp_path / "q"
    save_quanto_folder(m, src)
    code, out, err = run_ckpt("dequant", src, "-q")
    assert code == 0, err
    dst = tmp_path / "q-dequant"
    assert not (dst / "quanto_qmap.json").exists()
    got = load_file(dst / "model.safetensors")
    assert_matches_quanto(m, got, ["0", "1", "2", "3"])
    assert bits_equal(got["0.bias"], m[0].bias.detach())
    assert not any(k.endswith(("_scale", "_data", "_shift")) for k in got)
    small_model().to(dtype).load_state_dict(got, strict=True)


def test_to_overrides_the_scale_dtype(tmp_path, run_ckpt):
    m = quantized(small_model, "qint4", torch.bfloat16)
    save_quanto_folder(m, tmp_path / "q")
    code, _, err = run_ckpt("dequant", tmp_path / "q", "-o", tmp_path / "out", "--to", "fp16", "-q")
    assert code == 0, err
    got = load_file(tmp_path / "out" / "model.safetensors")
    for name in ["0", "1", "2", "3"]:
        assert bits_equal(got[f"{name}.weight"], m.get_submodule(name).weight.dequantize().to(torch.float16))
    assert got["0.bias"].dtype == torch.float16


def test_grouped_without_bias_needs_shapes_from(tmp_path, run_ckpt):
    def model():
        return torch.nn.Sequential(torch.nn.Linear(256, 32, bias=False), torch.nn.Conv2d(64, 32, 3))

    torch.manual_seed(1)
    plain = model().to(torch.float16)
    save_file(dict(plain.state_dict()), tmp_path / "plain.safetensors")
    m = model().to(torch.float16)
    m.load_state_dict(plain.state_dict())
    quantize(m, weights=qint4)
    freeze(m)
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, tmp_path / "q.safetensors")
    code, _, err = run_ckpt("dequant", tmp_path / "q.safetensors", "-q")
    assert code == 2 and "--shapes-from" in err and "0.weight._data._data" in err, err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "q-dequant.safetensors").exists()
    code, _, err = run_ckpt("dequant", tmp_path / "q.safetensors", "--shapes-from", tmp_path / "plain.safetensors", "-q")
    assert code == 0, err
    got = load_file(tmp_path / "q-dequant.safetensors")
    assert got["1.weight"].shape == (32, 64, 3, 3)  # a grouped Conv: only the reference knows it is 4-D
    assert_matches_quanto(m, got, ["0", "1"])
    model().to(torch.float16).load_state_dict(got, strict=True)


def test_int4_or_int2_with_two_rows_needs_qtype(tmp_path, run_ckpt):
    def model():
        return torch.nn.Sequential(torch.nn.Linear(20, 2, bias=False))

    m = quantized(model, "qint2", torch.float32)
    save_quanto_folder(m, tmp_path / "q", qmap=False)
    code, _, err = run_ckpt("dequant", tmp_path / "q", "-q")
    assert code == 2 and "--qtype" in err, err
    assert not (tmp_path / "q-dequant").exists()
    code, _, err = run_ckpt("dequant", tmp_path / "q", "--qtype", "qint2", "-q")
    assert code == 0, err
    assert_matches_quanto(m, load_file(tmp_path / "q-dequant" / "model.safetensors"), ["0"])


def test_qtype_conflicting_with_qmap_is_refused(tmp_path, run_ckpt):
    save_quanto_folder(quantized(small_model, "qint4", torch.float32), tmp_path / "q")
    code, _, err = run_ckpt("dequant", tmp_path / "q", "--qtype", "qint2", "-q")
    assert code == 2 and "conflicts" in err and "quanto_qmap.json" in err, err


@pytest.mark.parametrize("legacy", [False, True], ids=["shift-u8", "legacy-zeropoint-pickle"])
def test_integer_shift_and_legacy_zeropoint(tmp_path, run_ckpt, legacy):
    qw = int_shift_weight(torch.float16)
    sd: dict = {}
    qw.save_to_state_dict(sd, "lin.weight.", False)
    packed, scale, shift = sd["lin.weight._data._data"], sd["lin.weight._scale"], sd["lin.weight._shift"]
    # The format definition, computed here: W = scale * (data - zero_point), in the scale's dtype.
    data = unpack_by_definition(packed, 4, scale.shape[0])
    formula = (scale * (data.to(torch.int8) - shift.to(torch.int8))).reshape(32, 256)
    assert bits_equal(formula, qw.dequantize())
    if legacy:  # optimum-quanto <= 0.2.2: `_zeropoint` and string metadata, in a pickle
        sd = {"lin.weight._data._data": packed, "lin.weight._scale": scale, "lin.weight._zeropoint": shift,
              "lin.weight.qtype": "qint4", "lin.weight.axis": "0", "lin.weight.group_size": "128",
              "lin.weight.size": "[32, 256]", "lin.weight.stride": "[256, 1]", "lin.weight._data.bits": "4",
              "lin.weight._data.size": str(list(data.shape)), "lin.weight._data.stride": "(128, 1)",
              "lin.input_scale": torch.ones((), dtype=torch.float16), "lin.output_scale": torch.ones((), dtype=torch.float16)}
        src = tmp_path / "old.pt"
        torch.save(sd, src)
        dst = tmp_path / "old-dequant.safetensors"
    else:
        src = tmp_path / "new.safetensors"
        sd["lin.bias"] = torch.zeros(32, dtype=torch.float16)  # gives out_features: the grouped shape is settled
        save_file({k: v.contiguous() for k, v in sd.items()}, src)
        dst = tmp_path / "new-dequant.safetensors"
    code, _, err = run_ckpt("dequant", src, "-q")
    assert code == 0, err
    got = load_file(dst)
    assert set(got) == ({"lin.weight"} if legacy else {"lin.weight", "lin.bias"})
    assert bits_equal(got["lin.weight"], formula)


def test_incomplete_quanto_weight_is_refused(tmp_path, run_ckpt):
    src = tmp_path / "bad.safetensors"
    save_file({"a.weight._data": torch.zeros(4, 4, dtype=torch.int8), "a.bias": torch.zeros(4)}, src)
    code, out, err = run_ckpt("dequant", src, "-q")
    assert code == 2 and "a.weight._scale" in err and str(src) in err, err
    assert not (tmp_path / "bad-dequant.safetensors").exists()


def test_lora_only_training_checkpoint_reports_nothing_quantized(tmp_path, run_ckpt):
    ck = tmp_path / "checkpoint-4000"
    ck.mkdir()
    save_file({"transformer.x.lora_A.weight": torch.zeros(4, 8), "transformer.x.lora_B.weight": torch.zeros(8, 4)},
              ck / "pytorch_lora_weights.safetensors")
    torch.save({"state": {}}, ck / "optimizer.bin")
    (ck / "training_state.json").write_text("{}")
    code, out, err = run_ckpt("dequant", ck)
    assert code == 0, err
    assert "nothing to dequantize" in out
    assert "pytorch_lora_weights.safetensors: 2 tensors" in err and "LoRA" in err and "optimizer.bin" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4000"]


def test_fp8_layouts_use_the_same_decoder_as_convert(tmp_path, run_ckpt):
    g = torch.Generator().manual_seed(0)
    src = tmp_path / "comfy.safetensors"
    save_file({"scaled_fp8": torch.zeros(0, dtype=torch.float8_e4m3fn),
               "x.weight": torch.randn(40, 30, generator=g).to(torch.float8_e4m3fn),
               "x.scale_weight": torch.tensor(0.37), "x.bias": torch.randn(40, generator=g).to(torch.bfloat16)}, src)
    assert run_ckpt("dequant", src, "-o", tmp_path / "d.safetensors", "-q")[0] == 0
    assert run_ckpt("convert", src, "--to", "bf16", "-o", tmp_path / "c.safetensors", "-q")[0] == 0
    d, c = load_file(tmp_path / "d.safetensors"), load_file(tmp_path / "c.safetensors")
    assert set(d) == set(c) == {"x.weight", "x.bias"}
    assert all(bits_equal(d[k], c[k]) for k in d)


# ------------------------------------------------------------------ diffusers (QuantoConfig / qmap folders)

FLUX = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=64,
            num_attention_heads=4, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[16, 24, 24])


@pytest.fixture(scope="module")
def flux_plain(tmp_path_factory):
    diffusers = pytest.importorskip("diffusers")
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("flux")
    diffusers.FluxTransformer2DModel(**FLUX).to(torch.bfloat16).save_pretrained(root / "plain")
    return root / "plain"


def _load_folder(folder):
    sd = {}
    for f in folder.glob("*.safetensors"):
        sd.update(load_file(f))
    return sd


def _check_flux(qmodel, out_folder):
    from diffusers import FluxTransformer2DModel
    from optimum.quanto import QModuleMixin

    sd = _load_folder(out_folder)
    names = [n for n, mod in qmodel.named_modules() if isinstance(mod, QModuleMixin)]
    assert names
    assert_matches_quanto(qmodel, sd, names)
    cfg = json.loads((out_folder / "config.json").read_text())
    assert "quantization_config" not in cfg
    FluxTransformer2DModel.from_config(cfg).to(torch.bfloat16).load_state_dict(sd, strict=True)
    return sd


@pytest.mark.parametrize("weights_dtype", ["int8", "int4"])
def test_diffusers_quantoconfig_training_checkpoint(tmp_path, run_ckpt, flux_plain, weights_dtype):
    """A SimpleTuner-like `checkpoint-N/` with a sharded diffusers QuantoConfig `transformer/`."""
    from diffusers import FluxTransformer2DModel, QuantoConfig

    q = FluxTransformer2DModel.from_pretrained(flux_plain, quantization_config=QuantoConfig(weights_dtype=weights_dtype),
                                               torch_dtype=torch.bfloat16)
    ck = tmp_path / "checkpoint-4000"
    q.save_pretrained(ck / "transformer", max_shard_size="300KB")
    torch.save({"state": {}}, ck / "optimizer.bin")
    (ck / "training_state.json").write_text('{"global_step": 4000}')
    assert len(list((ck / "transformer").glob("*.safetensors"))) > 1
    code, out, err = run_ckpt("dequant", ck, "-q")
    assert code == 0, err
    dst = tmp_path / "dequant-checkpoint-4000"  # never `checkpoint-*`: trainers would resume from it or delete it
    sd = _check_flux(q, dst / "transformer")
    index = json.loads(next((dst / "transformer").glob("*.index.json")).read_text())
    assert set(index["weight_map"]) == set(sd)
    assert not (dst / "training_state.json").exists() and not (dst / "optimizer.bin").exists()  # a model, not a run


def test_optimum_quanto_save_folder_uses_config_model_class(tmp_path, run_ckpt, flux_plain):
    """QuantizedDiffusersModel.save_pretrained: quanto_qmap.json + config.json; grouped int4 shapes come
    from the model class built on the meta device (optimum-quanto also quantizes non-Linear layers, so a
    bias alone does not settle them)."""
    from diffusers import FluxTransformer2DModel
    from optimum.quanto import QuantizedDiffusersModel

    class QFlux(QuantizedDiffusersModel):
        base_class = FluxTransformer2DModel

    q = QFlux.quantize(FluxTransformer2DModel.from_pretrained(flux_plain, torch_dtype=torch.bfloat16), weights=qint4)
    q.save_pretrained(tmp_path / "q")
    assert (tmp_path / "q" / "quanto_qmap.json").is_file()
    code, out, err = run_ckpt("dequant", tmp_path / "q", "-o", tmp_path / "out")
    assert code == 0, err
    assert "meta device" in err
    assert not (tmp_path / "out" / "quanto_qmap.json").exists()
    _check_flux(q._wrapped, tmp_path / "out")


def test_shapes_from_hub_reads_headers_only(tmp_path, run_ckpt, monkeypatch):
    """`--shapes-from owner/name/subfolder`: shapes come from the repository's safetensors headers
    (huggingface_hub's header parser, faked here: tests never touch the network)."""
    from types import SimpleNamespace

    import huggingface_hub

    def model():
        return torch.nn.Sequential(torch.nn.Linear(256, 32, bias=False))

    m = quantized(model, "qint4", torch.float32)
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, tmp_path / "q.safetensors")
    asked = []
    names = ["README.md", "transformer/diffusion_pytorch_model.safetensors", "vae/x.safetensors"]
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, repo, revision=None, timeout=None:
                        SimpleNamespace(siblings=[SimpleNamespace(rfilename=n) for n in names]))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))  # nothing cached: the headers are read remotely
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

    def parse(self, repo, filename, revision=None):
        asked.append((repo, filename, revision))
        return SimpleNamespace(tensors={"0.weight": SimpleNamespace(shape=[32, 256])})

    monkeypatch.setattr(huggingface_hub.HfApi, "parse_safetensors_file_metadata", parse)
    code, _, err = run_ckpt("dequant", tmp_path / "q.safetensors", "--shapes-from", "someone/base@main/transformer", "-q")
    assert code == 0, err
    assert asked == [("someone/base", "transformer/diffusion_pytorch_model.safetensors", "main")]
    assert_matches_quanto(m, load_file(tmp_path / "q-dequant.safetensors"), ["0"])


def test_no_grouped_layer_fits_so_no_flag_needed(tmp_path, run_ckpt):
    """Linear(64 -> 32) without bias stores 32 x 64 codes like a grouped layer would, but no in_features
    > 128 that optimum-quanto groups by 64 divides 32 * 64 values: the shape is settled without help."""
    def model():
        return torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False))

    m = quantized(model, "qint4", torch.bfloat16)
    save_quanto_folder(m, tmp_path / "q", qmap=False)
    code, _, err = run_ckpt("dequant", tmp_path / "q", "-q")
    assert code == 0, err
    got = load_file(tmp_path / "q-dequant" / "model.safetensors")
    assert_matches_quanto(m, got, ["0"])
    model().to(torch.bfloat16).load_state_dict(got, strict=True)


def test_transformers_folder_shapes_from_config_model_class(tmp_path, run_ckpt):
    """A transformers folder whose config.json says quant_method "quanto" (weights int4): q/k/v/o and MLP
    projections have no bias and are grouped, so only the model class (built on the meta device from
    config.json) knows their shapes."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    conf = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=64)
    m = transformers.LlamaForCausalLM(conf).to(torch.float16)
    quantize(m.model.layers, weights=qint4)
    freeze(m)
    src = tmp_path / "llama-int4"
    src.mkdir()
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, src / "model.safetensors")
    cfg = m.config.to_dict() | {"architectures": ["LlamaForCausalLM"],  # as save_pretrained writes it
                                "quantization_config": {"quant_method": "quanto", "weights": "int4"}}
    (src / "config.json").write_text(json.dumps(cfg))
    code, _, err = run_ckpt("dequant", src, "-q")
    assert code == 0, err
    out = tmp_path / "llama-int4-dequant"
    got = load_file(out / "model.safetensors")
    names = [f"model.layers.0.{n}" for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                             "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    assert_matches_quanto(m, got, names)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    plain = transformers.LlamaForCausalLM(conf).to(torch.float16)
    plain.load_state_dict(got, strict=True)


@pytest.mark.parametrize("qtype,dtype", [("qint8", "bf16"), ("qint4", "fp16")])
def test_bench_source_and_quanto_baseline_agree_with_ckpt(tmp_path, qtype, dtype):
    """scripts/bench_dequant.py in-process on a tiny model: its synthetic quanto source, dequantized by
    the optimum-quanto way (requantize + .dequantize()) and by ckpt, gives identical files."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import bench_dequant

    from ckpt.dequant.command import DequantOptions, dequant

    src, ref = tmp_path / "src", tmp_path / "quanto"
    info = bench_dequant.write_source(str(src), 0.002, qtype, dtype)
    assert info["tensors"] > 50
    bench_dequant.quanto_way(str(src), str(ref), 0.002)
    out, _ = dequant(str(src), tmp_path / "ckpt", DequantOptions(quiet=True))
    a, b = load_file(out / "model.safetensors"), load_file(ref / "model.safetensors")
    assert set(a) == set(b)
    assert all(bits_equal(a[k], b[k]) for k in a)


def _fake_hub_cache(root, repo: str, files: dict, revision="a" * 40):
    """The folder layout huggingface_hub's cache uses: models--owner--name/{refs/main, snapshots/REV/...}."""
    base = root / ("models--" + repo.replace("/", "--"))
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(revision)
    for rel, tensors in files.items():
        p = base / "snapshots" / revision / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, p)
    return base


def _grouped_q4(tmp_path):
    def model():
        return torch.nn.Sequential(torch.nn.Linear(256, 32, bias=False))

    m = quantized(model, "qint4", torch.float32)
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, tmp_path / "q.safetensors")
    return m


@pytest.mark.parametrize("offline", [True, False], ids=["HF_HUB_OFFLINE", "dead-network"])
def test_shapes_from_hub_uses_the_cache_first(tmp_path, run_ckpt, monkeypatch, offline):
    """A cached repository answers --shapes-from without the network, offline or not."""
    m = _grouped_q4(tmp_path)
    _fake_hub_cache(tmp_path / "hub", "someone/base", {"transformer/diffusion_pytorch_model.safetensors":
                                                       {"0.weight": torch.zeros(32, 256)}})
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there: any request would fail
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    code, _, err = run_ckpt("dequant", tmp_path / "q.safetensors", "--shapes-from", "someone/base/transformer", "-q")
    assert code == 0, err
    assert_matches_quanto(m, load_file(tmp_path / "q-dequant.safetensors"), ["0"])


@pytest.mark.parametrize("offline", [True, False], ids=["HF_HUB_OFFLINE", "dead-network"])
def test_shapes_from_hub_not_cached_is_one_line_without_retries(tmp_path, run_ckpt, monkeypatch, caplog, offline):
    _grouped_q4(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    code, out, err = run_ckpt("dequant", tmp_path / "q.safetensors", "--shapes-from", "someone/base", "-q")
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("error: --shapes-from someone/base: not ")
    assert ("HF_HUB_OFFLINE is set" in err) == offline
    assert not any("Retrying" in r.getMessage() for r in caplog.records)
    assert not (tmp_path / "q-dequant.safetensors").exists()
