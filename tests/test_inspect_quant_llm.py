"""`ckpt inspect` on the quantized LLM checkpoints people download (GPTQ, AWQ, compressed-tensors, ModelOpt NVFP4,
gpt-oss MXFP4, HQQ): each format with its bits / group size / strategy, and which tensors stay unquantized, in the
text output and in `--json`, asserted against the config each format's test builder wrote (the builders run the
formats' own packers: AutoGPTQ, AutoAWQ, compressed-tensors, ModelOpt, hqq)."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from helpers import awq_base as awq_t, gptq_base as gptq_t, hqq_base as hqq_t, modelopt_base as modelopt_t
from helpers import ct_ref, mxfp4_ref

LAYER = "model.layers.0."


def _inspect(run_ckpt, folder) -> tuple[list[str], dict]:
    code, text, err = run_ckpt("inspect", folder)
    assert code == 0, err
    code, js, err = run_ckpt("inspect", folder, "--json")
    assert code == 0, err
    (comp,) = json.loads(js)["components"]
    return text.splitlines(), comp


def _rows(lines: list[str], key: str) -> list[str]:
    """The text rows of one field: its first row ("  quantized   ...") and the continuation rows under it."""
    out, inside = [], False
    for line in lines:
        if line.startswith(f"  {key:<11} "):
            inside = True
        elif not line.startswith("  " + " " * 12):
            inside = False
        if inside:
            out.append(" ".join(line[14:].split()))
    return out


def _qc(folder) -> dict:
    return json.loads((folder / "config.json").read_text())["quantization_config"]


def _stored_matrices(folder, quantized) -> list[str]:
    """The stored tensors of 2+ dims that `quantized(name)` does not claim, in stored order."""
    with safe_open(folder / "model.safetensors", "pt") as f:
        return [k for k in f.keys() if len(f.get_slice(k).get_shape()) >= 2 and not quantized(k)]


def _check(run_ckpt, folder, expected_layers: list[tuple[str, int, dict]], quantized) -> dict:
    """expected_layers: (label, tensors, settings) each; the unquantized matrices are the stored ones `quantized`
    does not claim."""
    lines, comp = _inspect(run_ckpt, folder)
    q = comp["quantization"]
    got = {x["label"]: x for x in q["layers"]}
    assert {lb: x["tensors"] for lb, x in got.items()} == {lb: n for lb, n, _ in expected_layers}
    for lb, _, settings in expected_layers:
        assert {k: got[lb]["settings"].get(k) for k in settings} == settings, got[lb]
    assert sorted(_rows(lines, "quantized")) == sorted(f"{n} tensor{'s' * (n != 1)} {lb}"
                                                       for lb, n, _ in expected_layers)
    mats = _stored_matrices(folder, quantized)
    assert sorted(q["unquantized"]["matrices"]) == sorted(mats)
    (row,) = _rows(lines, "unquantized")
    assert row.startswith(f"{q['unquantized']['tensors']} tensors {len(mats)} matrices: ")
    assert all(name in row for name in q["unquantized"]["matrices"][:4])
    assert "lm_head.weight" in mats and "model.embed_tokens.weight" in mats
    return q


def _under(layers):
    return lambda k: any(k.startswith(f"{LAYER}{lin}.") for lin in layers)


@pytest.mark.parametrize("bits,group,desc_act,sym,fmt", [(4, 32, True, False, None), (8, -1, False, True, "gptq_v2"),
                                                         (3, 32, False, True, None), (2, 64, True, True, None)])
def test_gptq(tmp_path, run_ckpt, bits, group, desc_act, sym, fmt):
    gptq_t.build(tmp_path / "q", bits=bits, group=group, desc_act=desc_act, sym=sym, fmt=fmt)
    qc = _qc(tmp_path / "q")
    zeros = "v2" if qc.get("checkpoint_format") == "gptq_v2" else "v1"
    expected: dict[str, list] = {}
    for lin in gptq_t.LINEARS:  # a layer whose inputs are one group is group_size -1, and cannot be act-order
        k = 128 if lin == "mlp.down_proj" else 64
        one = qc["group_size"] == -1 or qc["group_size"] >= k
        act = qc["desc_act"] and not one
        grouping = "one group per row (group_size -1)" if one else f"group {qc['group_size']}"
        label = (f"GPTQ {qc['bits']}-bit, {grouping}, {'sym' if qc['sym'] else 'asym'}"
                 + (", act-order (g_idx)" if act else "") + f", {zeros} zero points")
        settings = {"format": "GPTQ", "bits": qc["bits"], "group_size": -1 if one else qc["group_size"],
                    "sym": qc["sym"], "act_order": act, "zero_points": zeros}
        expected.setdefault(label, [label, 0, settings])[1] += 1
    _check(run_ckpt, tmp_path / "q", [tuple(v) for v in expected.values()], _under(gptq_t.LINEARS))


@pytest.mark.parametrize("version,group", [("gemm", 32), ("gemv", 64)])
def test_awq(tmp_path, run_ckpt, version, group):
    awq_t.build(tmp_path / "q", version=version, group=group)
    qc = _qc(tmp_path / "q")
    label = f"AWQ {qc['bits']}-bit {qc['version'].upper()}, group {qc['group_size']}, asym"  # zero_point: true
    assert qc["zero_point"] is True
    settings = {"format": "AWQ", "bits": 4, "group_size": qc["group_size"], "version": qc["version"].upper(),
                "sym": False}
    _check(run_ckpt, tmp_path / "q", [(label, len(awq_t.LINEARS), settings)], _under(awq_t.LINEARS))


@pytest.mark.parametrize("nbits,group,axis", [(4, 64, 1), (2, 32, 0), (8, 64, 0)])
def test_hqq(tmp_path, run_ckpt, nbits, group, axis):
    hqq_t.build(tmp_path / "q", nbits=nbits, group=group, axis=axis)
    qc = _qc(tmp_path / "q")["quant_config"]["weight_quant_params"]
    label = f"HQQ {qc['nbits']}-bit, group {qc['group_size']}, axis {qc['axis']}"
    settings = {"format": "HQQ", "bits": qc["nbits"], "group_size": qc["group_size"], "axis": qc["axis"]}
    _check(run_ckpt, tmp_path / "q", [(label, len(hqq_t.LINEARS), settings)], _under(hqq_t.LINEARS))


def test_modelopt_nvfp4(tmp_path, run_ckpt):
    modelopt_t.build(tmp_path / "q")
    quant = json.loads((tmp_path / "q" / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == "NVFP4"
    label = f"ModelOpt NVFP4, group {quant['group_size']}"
    settings = {"format": "ModelOpt", "type": "nvfp4", "bits": 4, "group_size": quant["group_size"]}
    q = _check(run_ckpt, tmp_path / "q", [(label, len(modelopt_t.LINEARS), settings)],
               _under(modelopt_t.LINEARS))
    assert "lm_head.weight" in q["unquantized"]["matrices"]  # exclude_modules


def test_gpt_oss_mxfp4(tmp_path, run_ckpt):
    packs, cfg = mxfp4_ref.build(tmp_path / "q")
    assert _qc(tmp_path / "q")["quant_method"] == "mxfp4"
    settings = {"format": "gpt-oss", "type": "mxfp4", "bits": 4, "group_size": 32}  # OCP MX: e8m0 per 32
    q = _check(run_ckpt, tmp_path / "q", [("gpt-oss MXFP4, group 32", len(packs), settings)],
               lambda k: k.endswith(("_blocks", "_scales")))
    assert f"{LAYER}mlp.router.weight" in q["unquantized"]["matrices"]  # modules_to_not_convert
    assert f"{LAYER}self_attn.q_proj.weight" in q["unquantized"]["matrices"]


def _ct_label(args) -> tuple[str, dict]:
    fmt = "pack-quantized"
    head = f"compressed-tensors int{args.num_bits} {fmt}"
    strategy = str(args.strategy.value if hasattr(args.strategy, "value") else args.strategy)
    parts = [head] + ([f"{strategy} strategy"] if strategy != "group" else [f"group {args.group_size}"])
    parts.append("sym" if args.symmetric else "asym")
    settings = {"format": "compressed-tensors", "bits": args.num_bits, "strategy": strategy, "sym": args.symmetric}
    return ", ".join(parts), settings | ({"group_size": args.group_size} if strategy == "group" else {})


def test_compressed_tensors_mixed_groups_and_ignore(tmp_path, run_ckpt):
    MIXED, MIXED_IGNORE = ct_ref.mixed()

    schemes = ct_ref.build(tmp_path / "q", MIXED, ignore=MIXED_IGNORE)
    qc = _qc(tmp_path / "q")
    assert qc["quant_method"] == "compressed-tensors"
    expected: dict[str, list] = {}
    for scheme in schemes.values():
        w = scheme.weights
        if str(getattr(w.type, "value", w.type)) == "float":  # NVFP4A16: e2m1 with fp8 scales per 16
            key = ("compressed-tensors nvfp4, group 16",
                   {"format": "compressed-tensors", "type": "nvfp4", "bits": 4, "group_size": w.group_size})
        else:
            key = _ct_label(w)
        expected.setdefault(key[0], [key[0], 0, key[1]])[1] += 1
    lines, comp = _inspect(run_ckpt, tmp_path / "q")
    got = {x["label"]: x for x in comp["quantization"]["layers"]}
    assert {lb: x["tensors"] for lb, x in got.items()} == {lb: n for lb, n, _ in expected.values()}
    for lb, _, settings in expected.values():
        assert {k: got[lb]["settings"].get(k) for k in settings} == settings
    assert sorted(_rows(lines, "quantized")) == sorted(f"{n} tensor{'s' * (n != 1)} {lb}"
                                                       for lb, n, _ in expected.values())
    quantized = {f"{m}.weight" for m in schemes}
    plain = comp["quantization"]["unquantized"]["matrices"]
    # the ignored Linears stay plain: lm_head, layer 1's o_proj (by regex), layer 0's down_proj (by name)
    for name in ("lm_head.weight", "model.layers.1.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        assert name in plain and name not in quantized
    assert not set(plain) & quantized
