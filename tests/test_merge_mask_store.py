"""DELLA's masks from the L1 rescale pass are kept for the merge pass (`ckpt.merge.mask_store`, issue 37): the store
gives back exactly the masks put in, over bands of any other size and start; a merge with the store ranks each row
once instead of twice and writes the same bytes as a merge without it (budget 0: every band ranked again, today's
path before the store), and every reservation is given back when the run ends."""

from __future__ import annotations

import filecmp

import pytest
import torch
import yaml

from ckpt.merge import mask_store
from ckpt.merge.mask_store import MaskStore
from helpers.merge_oracle import variants


def test_the_store_gives_back_what_was_put_over_other_bands():
    g = torch.Generator().manual_seed(3)
    n = 10_007
    masks = {m: torch.rand(n, generator=g) < 0.4 for m in (1, 2)}
    before = mask_store.reserved()
    store = MaskStore.reserve(n, 2)
    assert store is not None and mask_store.reserved() == before + 2 * -(-n // 8)
    put_edges = [0, 1000, 1003, 4096, 7777, n]  # stored bands of uneven sizes, starts not on a byte
    for m, mask in masks.items():
        for a, b in zip(put_edges, put_edges[1:]):
            store.put(m, a, mask[a:b].clone())
    assert store.get(1, n, (1,)) is None  # past the end: not covered
    get_edges = [0, 13, 999, 1001, 5000, 5001, n]  # read bands that straddle stored ones
    for a, b in zip(get_edges, get_edges[1:]):
        for m, mask in masks.items():
            got = store.get(m, a, (b - a,))
            assert got is not None and torch.equal(got, mask[a:b]), (m, a, b)
    assert mask_store.reserved() == before  # everything served: the reservation is back
    assert store.get(1, 0, (10,)) is None  # served bands are dropped


def test_a_gap_is_not_covered_and_the_budget_refuses(monkeypatch):
    store = MaskStore.reserve(100, 1)
    store.put(0, 0, torch.ones(40, dtype=torch.bool))
    store.put(0, 50, torch.ones(50, dtype=torch.bool))
    assert store.get(0, 30, (30,)) is None
    store.release()
    store.release()  # idempotent
    monkeypatch.setattr(mask_store, "BUDGET", mask_store.reserved() + 10)
    assert MaskStore.reserve(81, 1) is None  # 11 bytes over a budget of 10 left
    ok = MaskStore.reserve(80, 1)  # 10 bytes: fits
    assert ok is not None
    ok.release()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return variants(tmp_path_factory.mktemp("models"), 3, dtype=torch.bfloat16)


@pytest.mark.parametrize("method", ["della", "della_linear"])
def test_della_ranks_once_and_writes_the_same_bytes(run_ckpt, tmp_path, monkeypatch, models, method):
    import ckpt.io.output
    from ckpt.merge import masks_cpu

    if not masks_cpu.available():
        pytest.skip("numba is not importable here: no compiled masks, no store")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({
        "merge_method": method, "base_model": str(models[0]),
        "models": [{"model": str(m), "parameters": {"weight": w, "density": p, "epsilon": 0.15}}
                   for m, w, p in zip(models[1:], (0.6, 0.5), (0.5, 0.35))],
        "parameters": {"normalize": True, "rescale": True}, "dtype": "float32"}, sort_keys=False))
    monkeypatch.setattr(ckpt.io.output, "BAND_ELEMS", 1000)  # stats bands of 1000 elements
    monkeypatch.setattr("ckpt.merge.tensor.BAND_ELEMS", 3000)  # merge bands of another size
    calls = []
    real = masks_cpu.della_keep
    monkeypatch.setattr(masks_cpu, "della_keep", lambda *a: calls.append(a[3].numel()) or real(*a))
    base = mask_store.reserved()
    ranked = {}
    for name, budget in (("store", mask_store.BUDGET), ("none", 0)):
        monkeypatch.setattr(mask_store, "BUDGET", budget)
        calls.clear()
        code, out, err = run_ckpt("merge", cfg, "-o", tmp_path / name, "-q", "--seed", "5")
        assert code == 0, err
        ranked[name] = sum(calls)
        assert mask_store.reserved() == base
    assert ranked["none"] == 2 * ranked["store"] > 0  # ranked in both passes without the store, once with it
    files = sorted(p.name for p in (tmp_path / "store").iterdir())
    match, mismatch, errors = filecmp.cmpfiles(tmp_path / "store", tmp_path / "none", files, shallow=False)
    assert not mismatch and not errors and "model.safetensors" in match
