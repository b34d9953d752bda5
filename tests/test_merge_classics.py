"""The SD classic merges of `ckpt merge` (weighted_sum, add_difference, train_difference, add_perpendicular) and
supermerger-style per-block alphas, with sd-mecha 1.1.8 as the oracle.

The models are tiny SDXL (and SD1) checkpoints under the names of sd-mecha's own `sdxl-sgm` / `sd1-ldm` configs
(`model.diffusion_model.input_blocks.N...`, with text encoder and VAE tensors beside them): two tensors of every
block for the supermerger block weights, a few blocks' for the classics; small shapes, random fp32 values,
written with safetensors. sd-mecha merges the same state dicts in fp32 (its default merge dtype) to fp32 output.

Tolerances: weighted_sum, add_difference and train_difference are the same elementwise fp32 operations in the
same order as sd-mecha's (alpha a 0-d fp32 tensor; torch.lerp; a.addcmul(b - c, alpha); alpha * 1.8 rounded in
fp32, the mask, then addcmul): bit for bit (rtol = atol = 0; train_difference runs at alpha 0.45, where
rounding alpha * 1.8 in fp64 instead would differ). add_perpendicular needs two whole-tensor sums, which ckpt
accumulates band by band in fp64 and sd-mecha in one fp32 reduction: rtol 1e-5, atol 1e-6 (a few fp32 ulps of
the projection coefficient); its largest tensor streams in 8 bands.
"""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from helpers.refusals import assert_refused

sd_mecha = pytest.importorskip("sd_mecha")

EXACT = dict(rtol=0, atol=0)
SUMS = dict(rtol=1e-5, atol=1e-6)
BIG = "model.diffusion_model.middle_block.0.emb_layers.1.weight"  # streamed in several bands


class _Quiet:
    """sd-mecha's progress bar, silenced."""

    def __init__(self, *a, **k):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

    def update(self, *a):
        pass

    def set_postfix(self, *a, **k):
        pass


def _group(key: str) -> str | None:
    m = re.match(r"^model\.diffusion_model\.(input_blocks\.\d+|middle_block|output_blocks\.\d+|time_embed|label_emb"
                 r"|out)\.", key)
    if m:
        return m.group(1)
    m = re.match(r"^(conditioner\.embedders\.\d+|cond_stage_model|first_stage_model)\.", key)
    return m.group(1) if m else None


def _keys(config: str) -> list[str]:
    """Two tensors of every block, the embedders, the final layer, each text encoder and the VAE (sd-mecha's
    names), plus an attention `to_out.0` inside a block and the VAE's `conv_out` (the substrings a filter
    `out.` also finds)."""
    from sd_mecha.extensions import model_configs

    meta = model_configs.resolve(config).keys()
    picked: dict[str, list[str]] = {}
    for k, m in meta.items():
        g = _group(k)
        if g is not None and len(m.shape) and "position_ids" not in k and len(picked.setdefault(g, [])) < 2:
            picked[g].append(k)
    extra = [next(k for k in meta if k.startswith("model.diffusion_model.middle_block.") and ".to_out.0." in k),
             "first_stage_model.decoder.conv_out.weight"]
    return sorted({k for ks in picked.values() for k in ks} | set(extra))


FEW = ("input_blocks.1", "middle_block", "out", "time_embed", "conditioner.embedders.0")  # the classics' tensors


def _models(tmp_path, config: str, n: int = 3, groups=None) -> list[dict]:
    """n state dicts (saved as a, b, c.safetensors) of `_keys(config)`, or of those of `groups` only."""
    from sd_mecha.extensions import model_configs

    meta = model_configs.resolve(config).keys()
    keys = [k for k in _keys(config) if groups is None or _group(k) in groups]
    g = torch.Generator().manual_seed(7)
    sds = []
    for i in range(n):
        sd = {}
        for k in keys:
            shape = (64, 8) if k == BIG else (7,) if len(meta[k].shape) == 1 else (5, 3)
            sd[k] = torch.randn(shape, generator=g)
        sds.append(sd)
    if n == 3:
        a, b, c = sds
        t = "model.diffusion_model.out.0.weight"
        c[t] = a[t].clone()  # A - C = 0: no perpendicular part (sd-mecha's NaN fallback)
        t = "model.diffusion_model.input_blocks.1.0.emb_layers.1.weight"
        b[t][0] = a[t][0]
        c[t][0] = a[t][0]  # |B - A| + |B - C| = 0: the train-difference mask is 0 there
    for name, sd in zip("abc", sds):
        save_file(sd, tmp_path / f"{name}.safetensors")
    return sds


@contextlib.contextmanager
def _tiny_config(sd: dict):
    """An sd-mecha model config of just these tensors, registered for the merge and removed after it (so no
    other test's config inference sees it): its recipes finalize over a dozen keys, not the 2,531 of
    `sdxl-sgm` (a second or two per merge otherwise). The merge methods do not read the config."""
    from sd_mecha.extensions import model_configs as mc

    cfg = mc.ModelConfigImpl("sdxl_tiny-ckpt_test", {"unet": mc.ModelComponent(
        {k: mc.KeyMetadata(list(v.shape), "float32") for k, v in sd.items()})})
    mc.register(cfg)
    try:
        yield cfg
    finally:
        del mc._model_configs_registry_base[cfg.identifier]


def _mecha_tiny(make, sds) -> dict:
    """sd-mecha's merge `make(nodes)` of the state dicts `sds` under `_tiny_config`."""
    with _tiny_config(sds[0]) as cfg:
        return _mecha(make([sd_mecha.model(sd, config=cfg) for sd in sds]))


def _mecha(recipe) -> dict:
    return sd_mecha.merge(recipe, output_dtype=torch.float32, threads=0, tqdm=_Quiet)


def _ckpt(run_ckpt, tmp_path, text: str, name: str, *flags) -> dict:
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(text)
    code, out, err = run_ckpt("merge", cfg, "-o", tmp_path / f"{name}.safetensors", "-q", *flags)
    assert code == 0, err
    return load_file(tmp_path / f"{name}.safetensors")


def _same(got: dict, want: dict, tol):
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k].to(got[k].dtype), **tol, msg=k)


def _oracle(method: str, nodes, alpha):
    kw = {} if alpha is None else {"alpha": alpha}
    a, b, *rest = nodes
    if method == "weighted_sum":
        return sd_mecha.weighted_sum(a, b, **kw)
    c = rest[0]
    if method == "add_difference":
        return sd_mecha.add_difference(a, b, c, **kw)
    if method == "train_difference":  # supermerger's Train Difference, as sd-mecha composes it
        return sd_mecha.add_difference(a, b, c, alpha=sd_mecha.train_difference_mask(a, b, c, **kw))
    return sd_mecha.add_perpendicular(a, b, c, **kw)


CLASSICS = {"weighted_sum": (2, 0.3, EXACT), "add_difference": (3, 0.7, EXACT),
            "train_difference": (3, 0.45, EXACT), "add_perpendicular": (3, 0.8, SUMS)}


@pytest.mark.parametrize("given", [True, False], ids=["alpha", "default"])
@pytest.mark.parametrize("method", list(CLASSICS))
def test_classic_equals_sd_mecha(run_ckpt, tmp_path, monkeypatch, method, given):
    monkeypatch.setattr("ckpt.io.output.BAND_ELEMS", 64)  # BIG is 8 bands: the perpendicular sums stream
    n, alpha, tol = CLASSICS[method]
    sds = _models(tmp_path, "sdxl-sgm", n, FEW)
    names = [str(tmp_path / f"{x}.safetensors") for x in "abc"[:n]]
    text = f"merge_method: {method}\nmodels: [{', '.join(names)}]\n"
    if given:
        text += f"parameters: {{alpha: {alpha}}}\n"
    got = _ckpt(run_ckpt, tmp_path, text, "out")
    want = _mecha_tiny(lambda nodes: _oracle(method, nodes, alpha if given else None), sds)
    _same(got, want, tol)
    a = sds[0]
    assert not torch.equal(got[BIG], a[BIG])
    if method == "add_perpendicular":
        t = "model.diffusion_model.out.0.weight"
        assert torch.equal(got[t], a[t])


def test_perpendicular_part_is_orthogonal(run_ckpt, tmp_path, monkeypatch):
    """What add_perpendicular adds to A is orthogonal to A - C over the whole streamed tensor, and with
    B - C parallel to A - C nothing is added."""
    monkeypatch.setattr("ckpt.io.output.BAND_ELEMS", 64)
    a, b, c = _models(tmp_path, "sdxl-sgm", 3, FEW)
    b2 = dict(b, **{BIG: c[BIG] + 2.5 * (a[BIG] - c[BIG])})
    save_file(b2, tmp_path / "b2.safetensors")
    paths = [tmp_path / x for x in ("a.safetensors", "b.safetensors", "c.safetensors", "b2.safetensors")]
    got = _ckpt(run_ckpt, tmp_path, f"merge_method: add_perpendicular\nmodels: [{paths[0]}, {paths[1]}, {paths[2]}]\n",
                "perp")
    added = (got[BIG] - a[BIG]).double()
    assert abs(float((added * (a[BIG] - c[BIG]).double()).sum())) < 1e-4 * float(added.norm())
    got = _ckpt(run_ckpt, tmp_path, f"merge_method: add_perpendicular\nmodels: [{paths[0]}, {paths[3]}, {paths[2]}]\n",
                "parallel")
    torch.testing.assert_close(got[BIG], a[BIG], rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------ supermerger block weights

def supermerger_alpha(n_in: int, values: list[float], vae: float | None = None) -> list[dict]:
    """A supermerger per-block alpha list (BASE, IN00.., M00, OUT00..) as ckpt `{filter, value}` conditions,
    first match wins: BASE is the time and label embedders and (last, a catch-all) the text encoders; INnn
    `input_blocks.nn.`, M00 `middle_block.`, OUTnn `output_blocks.nn.`; the UNet's final `out.` layers take
    the last OUT, after every block filter (so no block's `to_out.` reaches it) and after the VAE's entry
    (whose `conv_out.` it would find too)."""
    assert len(values) == 2 * n_in + 2
    base, ins, mid, outs = values[0], values[1:1 + n_in], values[1 + n_in], values[2 + n_in:]
    conds = [{"filter": "time_embed.", "value": base}, {"filter": "label_emb.", "value": base}]
    conds += [{"filter": f"input_blocks.{i}.", "value": v} for i, v in enumerate(ins)]
    conds += [{"filter": "middle_block.", "value": mid}]
    conds += [{"filter": f"output_blocks.{i}.", "value": v} for i, v in enumerate(outs)]
    conds += [{"filter": "first_stage_model.", "value": base if vae is None else vae},
              {"filter": "out.", "value": outs[-1]}, {"value": base}]
    return conds


SUPERMERGER = {"sdxl": ("sdxl-sgm", "sdxl-supermerger_blocks", 9, True),
               "sd1": ("sd1-ldm", "sd1-supermerger_blocks", 12, False)}


@pytest.mark.parametrize("arch", list(SUPERMERGER))
def test_supermerger_block_weights_equal_sd_mecha(run_ckpt, tmp_path, arch):
    config, blocks_config, n_in, has_vae = SUPERMERGER[arch]
    a, b = _models(tmp_path, config, 2)
    values = [round(0.05 + 0.9 * i / (2 * n_in + 1), 4) for i in range(2 * n_in + 2)]  # all different
    vae = 0.0 if has_vae else None  # SDXL: sd-mecha's VAE entry (the VAE stays A's); SD1 maps the VAE to BASE
    cfg = {"merge_method": "weighted_sum", "models": [str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")],
           "parameters": {"alpha": supermerger_alpha(n_in, values, vae)}}
    got = _ckpt(run_ckpt, tmp_path, yaml.safe_dump(cfg, sort_keys=False), "blocks")

    labels = ["BASE"] + [f"IN{i:02}" for i in range(n_in)] + ["M00"] + [f"OUT{i:02}" for i in range(n_in)]
    per_block = {k: torch.tensor(v) for k, v in zip(labels, values)}
    if has_vae:
        per_block["VAE"] = torch.tensor(vae)
    alpha = sd_mecha.convert(sd_mecha.literal(per_block, config=blocks_config), config)
    nodes = [sd_mecha.model(sd, config=config) for sd in (a, b)]
    want = _mecha(sd_mecha.weighted_sum(*nodes, alpha=alpha))
    _same(got, want, EXACT)
    k = "model.diffusion_model.out.0.weight"  # the last OUT's value, not BASE's
    torch.testing.assert_close(got[k], torch.lerp(a[k], b[k], values[-1]), **EXACT)


# ------------------------------------------------------------------------------------- flags and the YAML

def test_flags_equal_the_yaml_and_sd_mecha(run_ckpt, tmp_path):
    a, b = _models(tmp_path, "sdxl-sgm", 2, FEW)
    pa, pb = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    code, out, err = run_ckpt("merge", pa, pb, "--alpha", "0.3", "-o", tmp_path / "flags.safetensors", "-q")
    assert code == 0, err
    code, printed, err = run_ckpt("merge", pa, pb, "--alpha", "0.3", "--print-config")
    assert code == 0, err
    assert yaml.safe_load(printed) == {"merge_method": "weighted_sum",
                                       "models": [{"model": str(pa)}, {"model": str(pb)}], "parameters": {"alpha": 0.3}}
    got = _ckpt(run_ckpt, tmp_path, printed, "printed")
    assert (tmp_path / "printed.safetensors").read_bytes() == (tmp_path / "flags.safetensors").read_bytes()
    hand = _ckpt(run_ckpt, tmp_path, f"merge_method: weighted_sum\nmodels: [{pa}, {pb}]\nparameters:\n  alpha: 0.3\n",
                 "hand")
    _same(hand, got, EXACT)
    want = _mecha_tiny(lambda nodes: sd_mecha.weighted_sum(*nodes, alpha=0.3), [a, b])
    _same(got, want, EXACT)


# ------------------------------------------------------------------------------------------- refusals

def test_bad_classic_configs_are_refused(run_ckpt, tmp_path):
    _models(tmp_path, "sdxl-sgm", 3, FEW)
    a, b, c = (tmp_path / f"{x}.safetensors" for x in "abc")
    bad = {
        "three": (f"merge_method: weighted_sum\nmodels: [{a}, {b}, {c}]\n", "weighted_sum merges exactly 2 models"),
        "based": (f"merge_method: add_difference\nbase_model: {c}\nmodels: [{a}, {b}]\n",
                  "add_difference takes models: [A, B, C] in order (A is the primary model), no base_model"),
        "unknown": (f"merge_method: weighted_sum\nmodels: [{a}, {b}]\nparameters: {{beta: 0.5}}\n",
                    "weighted_sum has no parameter 'beta' (it takes alpha)"),
        "two": (f"merge_method: train_difference\nmodels: [{a}, {b}]\n", "train_difference merges exactly 3 models"),
        "sliced": (f"merge_method: weighted_sum\nslices:\n  - sources:\n      - {{model: {a}, layer_range: [0, 2]}}\n"
                   f"      - {{model: {b}, layer_range: [0, 2]}}\n", "slices: are for the mergekit methods"),
    }
    for name, (text, problem) in bad.items():
        cfg = tmp_path / f"{name}.yaml"
        cfg.write_text(text)
        assert_refused(run_ckpt, tmp_path, ("merge", cfg, "-o", tmp_path / "out.safetensors"), str(cfg), problem)
    assert_refused(run_ckpt, tmp_path, ("merge", a, b, c, "--method", "add_perpendicular", "--base", c, "-o",
                                        tmp_path / "out.safetensors"), "merge: add_perpendicular takes models",
                   "no base_model")
