"""torchao weight-only checkpoints (transformers' TorchAoConfig saves) decoded by `ckpt dequant` / `convert`,
bit for bit with torchao 0.18's own `dequantize()`.

The oracle is torchao itself, run in a subprocess (tests/helpers/torchao_ref.py: installed with `pip install
--target` under `.venv/`, never imported by this process). It quantizes a tiny LlamaForCausalLM through
transformers 5.24 (`from_pretrained(..., quantization_config=TorchAoConfig(config))`), saves it with
`save_pretrained` (torchao's `flatten_tensor_state_dict`: `X._weight_qdata`, `X._weight_scale`,
`X._weight_zero_point` and per-tensor `__metadata__`), and writes each quantized parameter's
`dequantize()`. The int4 layouts cannot be made on a CPU (their quantizers are CUDA kernels), so their
refusals are shown on a save whose metadata names them.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from helpers import torchao_ref
from helpers.format_cases import assert_bands_equal_the_whole
from helpers.refusals import assert_refused
from safetensors import safe_open
from safetensors.torch import load_file, save_file

CONFIGS = {
    "int8 per row": ("Int8WeightOnlyConfig()", "bfloat16"),
    "int8 per row fp16": ("Int8WeightOnlyConfig()", "float16"),
    "int8 per group": ("Int8WeightOnlyConfig(granularity=PerGroup(32))", "bfloat16"),
    "int8 per tensor": ("Int8WeightOnlyConfig(granularity=PerTensor())", "float32"),
    "int8 dynamic act": ("Int8DynamicActivationInt8WeightConfig()", "bfloat16"),
    "intx int4 asym": ("IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32), "
                       "mapping_type=MappingType.ASYMMETRIC)", "bfloat16"),
    "intx int2 sym": ("IntxWeightOnlyConfig(weight_dtype=torch.int2, granularity=PerGroup(16))", "float16"),
    "intx int8 per axis": ("IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0))", "bfloat16"),
    "float8 per row": ("Float8WeightOnlyConfig()", "bfloat16"),
    "float8 per row fp16": ("Float8WeightOnlyConfig()", "float16"),
    "mixed per module": ('FqnToConfig({"re:.*mlp.*": Float8WeightOnlyConfig(), "model.layers.1.self_attn.q_proj": '
                         'IntxWeightOnlyConfig(weight_dtype=torch.int3, granularity=PerGroup(16)), '
                         '"_default": Int8WeightOnlyConfig()})', "bfloat16"),
}
L = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """case -> (folder, reference tensors, subclass names), each torchao save made once."""
    cache = {}

    def get(case):
        if case not in cache:
            try:
                torchao_ref.folder()
            except torchao_ref.Unavailable as e:
                pytest.skip(str(e))
            out = tmp_path_factory.mktemp(case.replace(" ", "_"))
            config, dtype = CONFIGS[case]
            cache[case] = (out, *torchao_ref.build(out, config, dtype))
        return cache[case]

    return get


def bits_equal(a, b):
    ints = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(ints[a.dtype]), b.view(ints[b.dtype]))


@pytest.mark.parametrize("case", list(CONFIGS))
def test_dequant_equals_torchao_bit_for_bit(made, tmp_path, run_ckpt, case):
    folder, ref, kinds = made(case)
    assert len(ref) == 14  # every Linear of both decoder layers; embeddings and lm_head stay plain
    if case == "mixed per module":  # FqnToConfig: three subclasses in one file, decoded per tensor
        assert sorted(set(kinds.values())) == ["Float8Tensor", "Int8Tensor", "IntxUnpackedToInt8Tensor"]
    with safe_open(folder / "q" / "model.safetensors", "pt") as f:
        stored, meta = set(f.keys()), f.metadata()
    assert f"{L}._weight_qdata" in stored and f"{L}.weight" not in stored and "tensor_names" in meta
    code, _, err = run_ckpt("dequant", folder / "q", "-o", tmp_path / "plain", "-q")
    assert code == 0, err
    out = load_file(tmp_path / "plain" / "model.safetensors")
    assert not any("._weight_" in k for k in out)
    for name, want in ref.items():
        assert bits_equal(out[name], want), (case, kinds[name], name)
    plain = load_file(folder / "plain" / "model.safetensors")
    assert set(out) == set(plain)  # same parameters as the unquantized model
    for name in set(plain) - set(ref):
        assert bits_equal(out[name], plain[name]), name
    with safe_open(tmp_path / "plain" / "model.safetensors", "pt") as f:
        assert "tensor_names" not in (f.metadata() or {})  # torchao's per-tensor metadata is not carried over
    assert_bands_equal_the_whole(folder / "q", list(ref))  # each subclass's bands
    assert "torchao" not in sys.modules  # the oracle ran in its subprocesses only


# --- bad input: one line, exit 2, nothing written -----------------------------------------------------


def _copy(src, dst, tensors=None, drop=(), meta=None):
    """The torchao save at `src` written to `dst` with tensors replaced/dropped and metadata entries changed."""
    import shutil

    shutil.copytree(src, dst)
    with safe_open(src / "model.safetensors", "pt") as f:
        md = dict(f.metadata())
    sd = load_file(src / "model.safetensors")
    for k in drop:
        del sd[k]
    sd.update(tensors or {})
    for k, edit in (meta or {}).items():
        md[k] = edit(md[k])
    save_file(sd, dst / "model.safetensors", metadata=md)


def _meta_set(key, value):
    """An edit of one tensor's JSON metadata entry: `key` set to `value` (its subclass `_type`, its
    `_tensor_data_names`)."""
    def edit(text):
        m = json.loads(text)
        m[key] = value
        return json.dumps(m)
    return edit


def _meta_data_set(key, value):
    """An edit of one setting in a tensor's metadata `_data` (its block_size, ...)."""
    def edit(text):
        m = json.loads(text)
        m["_data"][key] = value
        return json.dumps(m)
    return edit


W = f"{L}.weight"
BAD = {
    "missing scale": (dict(drop=[f"{L}._weight_scale"]), f"{L}._weight_scale", "is missing"),
    "missing zero point": (dict(drop=[f"{L}._weight_zero_point"]), f"{L}._weight_zero_point", "is missing"),
    "missing qdata": (dict(drop=[f"{L}._weight_qdata"]), f"{L}._weight_qdata", "is missing"),
    "scale shape": (dict(tensors={f"{L}._weight_scale": torch.ones(32, 2, dtype=torch.bfloat16)}),
                    f"{L}._weight_scale", "expected a floating dtype, shape [64, 2]"),
    "zero point shape": (dict(tensors={f"{L}._weight_zero_point": torch.zeros(64, 1, dtype=torch.int8)}),
                         f"{L}._weight_zero_point", "shape [64, 2]"),
    "qdata shape": (dict(tensors={f"{L}._weight_qdata": torch.zeros(64, 96, dtype=torch.int8)}),
                    f"{L}._weight_scale", "expected a floating dtype, shape [64, 3]"),
    "qdata not blocks": (dict(tensors={f"{L}._weight_qdata": torch.zeros(64, 48, dtype=torch.int8)}),
                         f"{L}._weight_qdata", "block_size of 'model.layers.0.self_attn.q_proj.weight' is [1, 32], "
                                               "which does not tile"),
    "qdata dtype": (dict(tensors={f"{L}._weight_qdata": torch.zeros(64, 64, dtype=torch.uint8)}),
                    f"{L}._weight_qdata", "expected I8"),
    "tinygemm int4": (dict(meta={W: _meta_set("_type", "Int4TilePackedTo4dTensor")}), f"{L}._weight_qdata",
                      "Int4TilePackedTo4dTensor: tinygemm's tiled int4 packing"),
    "mslk int4": (dict(meta={W: _meta_set("_type", "Int4Tensor")}), f"{L}._weight_qdata", "stored as Int4Tensor"),
    "unknown class": (dict(meta={W: _meta_set("_type", "SomeNewTensor")}), f"{L}._weight_qdata",
                      "a torchao tensor subclass ckpt does not know"),
    "act_pre_scale": (dict(tensors={f"{L}._weight_act_pre_scale": torch.ones(64)},
                           meta={W: _meta_set("_tensor_data_names",
                                              ["qdata", "scale", "zero_point", "act_pre_scale"])}),
                      f"{L}._weight_act_pre_scale", "does not fold it in"),
    "stray datum": (dict(tensors={f"{L}._weight_scale_and_zero": torch.ones(2)}), f"{L}._weight_scale_and_zero",
                    "is not among the tensor data"),
    "no metadata entry": (dict(meta={"tensor_names": lambda t: json.dumps([n for n in json.loads(t) if n != W])}),
                          f"{L}._weight_qdata", "no torchao __metadata__ entry"),
    "plain and packed": (dict(tensors={W: torch.zeros(64, 64, dtype=torch.bfloat16)}), W, "stored both plain"),
    "block_size true": (dict(meta={W: _meta_data_set("block_size", [1, True])}), f"{L}._weight_qdata",
                        "block_size of 'model.layers.0.self_attn.q_proj.weight' is [1, True], which does not tile"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_one_line_exit_2_nothing_written(made, tmp_path, run_ckpt, case):
    edit, key, needle = BAD[case]
    folder, _, _ = made("intx int4 asym")
    _copy(folder / "q", tmp_path / "q", **edit)
    for args in (("dequant", tmp_path / "q"), ("convert", tmp_path / "q", "--to", "bf16")):
        assert_refused(run_ckpt, tmp_path, args, f"{tmp_path / 'q' / 'model.safetensors'}: ", needle)
        assert key in run_ckpt(*args)[2]


def test_metadata_stripped_is_refused(made, tmp_path, run_ckpt):
    """The flattened keys without torchao's metadata: nothing says what they are, so nothing is guessed."""
    folder, _, _ = made("int8 per row")
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "config.json").write_text((folder / "q" / "config.json").read_text())
    save_file(load_file(folder / "q" / "model.safetensors"), tmp_path / "q" / "model.safetensors")
    assert_refused(run_ckpt, tmp_path, ("dequant", tmp_path / "q"), f"{tmp_path / 'q' / 'model.safetensors'}: ",
                   "looks like flattened torchao tensor data, but no torchao __metadata__ entry")


def test_pickled_tensor_subclasses_are_refused(tmp_path, run_ckpt):
    """`torch.save` of a torchao model's state dict pickles the subclasses themselves: refused in one line,
    naming the torchao class, before anything is unpickled."""
    try:
        torchao_ref.folder()
    except torchao_ref.Unavailable as e:
        pytest.skip(str(e))
    torchao_ref.build(tmp_path / "b", "Int8WeightOnlyConfig()", safetensors=False)
    assert_refused(run_ckpt, tmp_path, ("dequant", tmp_path / "b" / "q"),
                   f"{tmp_path / 'b' / 'q' / 'pytorch_model.bin'}: ", "torchao.quantization.Int8Tensor")


def test_config_naming_torchao_without_its_metadata_is_refused(made, tmp_path, run_ckpt):
    """config.json says torchao but the safetensors carry no torchao metadata: which tensors were quantized,
    and how, is not written anywhere, so nothing is guessed (and the config is not silently kept)."""
    folder, _, _ = made("int8 per row")
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "config.json").write_text((folder / "q" / "config.json").read_text())
    save_file(load_file(folder / "plain" / "model.safetensors"), tmp_path / "q" / "model.safetensors")
    assert_refused(run_ckpt, tmp_path, ("dequant", tmp_path / "q"), f"{tmp_path / 'q' / 'model.safetensors'}: ",
                   "config.json quantization_config names torchao, but the weights carry no torchao")


@pytest.mark.parametrize("case", ["int8 per row", "int8 per group", "int8 per tensor", "intx int4 asym", "intx int2 sym",
                                  "float8 per row", "mixed per module"])
def test_inspect_names_bits_and_granularity_from_torchaos_metadata(made, run_ckpt, case):
    """`inspect` says, per quantized tensor, what torchao wrote in its metadata: the code type (int8, an intx
    target_dtype, a float8), the granularity its block_size means, and the mapping the config asked for."""
    folder, ref, kinds = made(case)
    with safe_open(folder / "q" / "model.safetensors", "pt") as f:
        meta, shapes = f.metadata(), {k: f.get_slice(k).get_shape() for k in f.keys()}
    want = {}
    for name, kind in kinds.items():
        data = json.loads(meta[name])
        module, _, param = name.rpartition(".")
        shape = shapes[f"{module}._{param}_qdata"]
        block = data["_data"].get("block_size") or shape  # float8: one scale per row
        if kind == "Float8Tensor" and "block_size" not in data["_data"]:
            block = [1, shape[1]]
        codes = (data["_data"]["target_dtype"]["_data"] if kind == "IntxUnpackedToInt8Tensor"
                 else "float8_e4m3fn" if kind == "Float8Tensor" else "int8")
        codes = codes.replace("torch.", "")
        strategy = ("tensor" if list(block) == list(shape) else "channel" if block == [1, shape[1]] else "group")
        s = {"format": "torchao", "type": codes, "packing": kind, "strategy": strategy}
        if strategy == "group":
            s["group_size"] = block[1]
        if codes.startswith("int"):  # torchao stores a zero point (of zeros) for symmetric mappings too
            s["sym"] = "MappingType.ASYMMETRIC" not in CONFIGS[case][0]
        want[name] = s
    code, js, err = run_ckpt("inspect", folder / "q", "--json")
    assert code == 0, err
    layers = json.loads(js)["components"][0]["quantization"]["layers"]
    got = {}
    for layer in layers:
        assert layer["settings"]["bits"] == int(layer["settings"]["type"].lstrip("intfloat").split("_")[0])
        got[layer["label"]] = {k: v for k, v in layer["settings"].items() if k != "bits"}
    assert sorted(map(json.dumps, got.values())) == sorted({json.dumps(s) for s in want.values()})
    assert sum(x["tensors"] for x in layers) == len(want)
