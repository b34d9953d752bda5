"""DARE's and DELLA's compiled CPU masks (`ckpt.merge.masks_cpu`) are the torch formulation bit for bit: the counter-
based uniform of `ckpt.merge.rng` against the density (DARE) or against the keep probability of each element's
magnitude rank in its row (DELLA, ranks by a stable argsort), so `--seed` gives the bytes it gave before the kernels
(issue 37). The oracle is the torch formulation itself, which stays the path on CUDA and without numba: kernel
against it on hard values (equal magnitudes, NaN of either sign, +-0, inf, rows of 1, dims past 2, offsets across
2^32, densities that round to fp32), then whole `ckpt merge` runs with and without the kernels, byte for byte."""

from __future__ import annotations

import filecmp
import struct

import pytest
import torch
import yaml

from helpers.merge_oracle import variants

pytestmark = pytest.mark.skipif(not __import__("ckpt.merge.masks_cpu", fromlist=["x"]).available(),
                                reason="numba is not importable here: the torch formulation is the only path")


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


# offsets: the start, an arbitrary one, a band that crosses 2^32 (the hash mixes the index's high word in), past it
OFFSETS = (0, 12345, (1 << 32) - 3000, (1 << 33) + 7)
# densities: plain ones, one just above an fp32 value (torch compares in fp32: rounds down to 0.5), extremes
DENSITIES = (0.3, 0.7, 0.5 + 2.0 ** -30, _f32(0.9) + 2.0 ** -40, 1e-7, 0.99999994)


@pytest.mark.parametrize("offset", OFFSETS)
def test_dare_mask_is_the_torch_formulation(offset):
    from ckpt.merge import masks_cpu
    from ckpt.merge.rng import keys, uniform

    k0, k1 = keys(5, "some/model", "model.layers.0.mlp.up_proj.weight")
    for density in DENSITIES:
        ours = masks_cpu.dare_keep(k0, k1, offset, (50, 121), density)
        ref = uniform(5, "some/model", "model.layers.0.mlp.up_proj.weight", offset, 50 * 121, "cpu") < density
        assert torch.equal(ours, ref.reshape(50, 121)), density


def _hard_delta(shape, g, bf16: bool):
    d = torch.randn(shape, generator=g) * 0.01
    if bf16:  # differences of bf16 values: few distinct magnitudes, many equal ones
        d = (torch.randn(shape, generator=g) * 0.02).bfloat16().float() - (
            torch.randn(shape, generator=g) * 0.02).bfloat16().float()
    flat = d.reshape(-1)
    if flat.numel() > 12:
        flat[1], flat[2], flat[9] = -0.0, 0.0, float("inf")
        flat[3] = float("nan")
        flat[7] = -flat[3]  # a NaN of the other sign: both rank above +inf, in index order
        flat[11] = float("-inf")
    return d


class _Band:
    def __init__(self, offset):
        self.offset = offset


class _Job:
    def __init__(self, density, epsilon):
        self.seed, self.keys, self.names = 3, ["base", "m1"], ("model.layers.1.x.weight",)
        self.per_input = [{}, {"density": density, "epsilon": epsilon}]


@pytest.mark.parametrize("shape", [(64, 96), (3, 700), (5, 40, 3), (3, 4, 5, 6), (300,), (7, 1), (1, 5), (1,), ()])
@pytest.mark.parametrize("bf16", [True, False])
def test_della_mask_is_the_torch_formulation(monkeypatch, shape, bf16):
    from ckpt.merge import masks_cpu
    from ckpt.merge.methods import task_arithmetic as ta

    della = next(c for c in ta.CONFIGS if c.name == "della")
    g = torch.Generator().manual_seed(len(shape) * 10 + bf16)
    d = _hard_delta(shape, g, bf16)
    for offset in (0, (1 << 32) - 50):
        for density, epsilon in ((0.5, 0.2), (0.3, 0.1), (0.6, 0.0), (0.5 + 2.0 ** -30, 0.49)):
            job, band = _Job(density, epsilon), _Band(offset)
            ours = ta._random_keep(della, job, 1, d, band)
            with monkeypatch.context() as m:
                m.setattr(masks_cpu, "available", lambda: False)
                ref = ta._random_keep(della, job, 1, d, band)
            assert ours.shape == ref.shape == d.shape and torch.equal(ours, ref), (offset, density, epsilon)


def test_della_probabilities_are_mergekits_per_element_formula():
    """The per-rank table the masks use is mergekit's per-element expression evaluated on the ranks (the same fp32
    operations in the same order), so replacing ranks by a table lookup changed no value."""
    from ckpt.merge.methods import task_arithmetic as ta

    g = torch.Generator().manual_seed(0)
    d = torch.randn(16, 333, generator=g)
    ranks = torch.argsort(torch.argsort(d.abs(), dim=1, stable=True), dim=1).float()
    for density, epsilon in ((0.5, 0.15), (0.35, 0.3), (0.7, 0.05)):
        expected = (density - epsilon) + (ranks / (333 - 1)) * 2 * epsilon  # mergekit's della_magprune, rank_norm
        assert torch.equal(ta._della_probs(d, density, epsilon), expected)


def _write_config(path, method, models, **params):
    path.write_text(yaml.safe_dump({
        "merge_method": method, "base_model": str(models[0]),
        "models": [{"model": str(m), "parameters": {"weight": w, "density": p, **params}}
                   for m, w, p in zip(models[1:], (0.6, 0.5), (0.5, 0.35))],
        "parameters": {"normalize": True}, "dtype": "float32"}, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return variants(tmp_path_factory.mktemp("models"), 3, dtype=torch.bfloat16)  # bf16: equal magnitudes abound


@pytest.mark.parametrize("method, params", [("dare_ties", {}), ("dare_linear", {}), ("della", {"epsilon": 0.2}),
                                            ("della_linear", {"epsilon": 0.1})])
def test_merge_writes_the_same_bytes_with_and_without_the_kernels(run_ckpt, tmp_path, monkeypatch, models, method,
                                                                   params):
    import ckpt.io.output
    from ckpt.merge import masks_cpu

    cfg = _write_config(tmp_path / "c.yaml", method, models, **params)
    monkeypatch.setattr(ckpt.io.output, "BAND_ELEMS", 1000)  # several bands per tensor: masks drawn per band
    code, out, err = run_ckpt("merge", cfg, "-o", tmp_path / "kernels", "-q", "--seed", "9")
    assert code == 0, err
    monkeypatch.setattr(masks_cpu, "available", lambda: False)
    code, out, err = run_ckpt("merge", cfg, "-o", tmp_path / "torch", "-q", "--seed", "9")
    assert code == 0, err
    files = sorted(p.name for p in (tmp_path / "torch").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "kernels").iterdir())
    match, mismatch, errors = filecmp.cmpfiles(tmp_path / "torch", tmp_path / "kernels", files, shallow=False)
    assert not mismatch and not errors and "model.safetensors" in match


def test_della_rows_longer_than_the_kernels_index_take_the_torch_formulation(monkeypatch):
    """The kernels pack an element's index in 32 bits; a longer row (a 1-D tensor of 2^32 elements, ranked whole)
    is left to the torch formulation, which gives the same bits. The limit is lowered here to take that branch."""
    from ckpt.merge import masks_cpu
    from ckpt.merge.methods import task_arithmetic as ta

    della = next(c for c in ta.CONFIGS if c.name == "della")
    d = _hard_delta((6, 50), torch.Generator().manual_seed(1), True)
    job, band = _Job(0.5, 0.2), _Band(77)
    calls = []
    monkeypatch.setattr(masks_cpu, "della_keep", lambda *a: calls.append(a))
    monkeypatch.setattr(masks_cpu, "MAX_ROW", 49)
    ours = ta._random_keep(della, job, 1, d, band)
    assert not calls  # the kernels were not asked
    monkeypatch.setattr(masks_cpu, "available", lambda: False)
    assert torch.equal(ours, ta._random_keep(della, job, 1, d, band))
