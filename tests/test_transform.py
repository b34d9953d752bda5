"""`ckpt.families.Transform`, the one definition of the family correspondence transforms that layout
conversion, merge-lora, lora extract and lora convert all use: checked here against plain torch on real
tensors, since every command's output rests on it (a wrong inverse or shape rule would corrupt weights
silently in each of them at once)."""

from __future__ import annotations

import pytest
import torch

from ckpt.families import Alias, Pair, Transform

# A tensor each transform takes, with what plain torch says the transform is.
CASES = {
    Transform.SWAP_HALVES: (torch.randn(6, 5), lambda x: torch.cat([x[3:], x[:3]])),
    Transform.TRANSPOSE: (torch.randn(4, 7), lambda x: x.T),
    Transform.SQUEEZE: (torch.randn(5, 3, 1, 1), lambda x: x[:, :, 0, 0]),
    Transform.UNSQUEEZE: (torch.randn(5, 3), lambda x: x[:, :, None, None]),
    Transform.SIX_ROWS: (torch.randn(18), lambda x: x.reshape(6, 3)),
    Transform.FLATTEN: (torch.randn(6, 3), lambda x: x.reshape(-1)),
}
REGROUPING = {Transform.SIX_ROWS, Transform.FLATTEN}  # 1-D modulation tables: no rows kept, no LoRA factors


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("tr", list(Transform))
def test_apply_is_what_torch_says(tr):
    x, want = CASES[tr]
    assert torch.equal(tr.apply(x), want(x))


@pytest.mark.parametrize("tr", list(Transform))
def test_inverse_undoes_it(tr):
    """Layout conversion goes back with the inverse, merge-lora puts a patched slice back with it."""
    x, _ = CASES[tr]
    y = tr.apply(x)
    assert torch.equal(tr.inverse.apply(y), x)
    assert tr.inverse.inverse is tr
    assert torch.equal(tr.apply(tr.inverse.apply(y)), y)


@pytest.mark.parametrize("tr", list(Transform))
def test_shape_rule_is_the_shape_of_apply(tr):
    """merge-lora checks a module against, and extract shapes its factors by, the rule without a tensor."""
    x, _ = CASES[tr]
    assert tr.shape(x.shape) == tuple(tr.apply(x).shape)
    assert tr.inverse.shape(tr.shape(x.shape)) == tuple(x.shape)


@pytest.mark.parametrize("tr", list(Transform))
def test_row_spans_stack_to_the_whole(tr):
    """Layout conversion builds the result lazily from these spans, band by band where rows stay rows."""
    x, _ = CASES[tr]
    spans = tr.row_spans(x.shape[0])
    if not tr.keeps_rows:
        assert spans is None
        return
    y = tr.apply(x)
    stacked = torch.cat([x[a:b] for a, b in spans])
    assert torch.equal(stacked.reshape(y.shape), y)


@pytest.mark.parametrize("tr", [t for t in Transform if t.row_local])
def test_row_local_ones_apply_band_by_band(tr):
    x, _ = CASES[tr]
    x = torch.cat([x] * 3)  # more rows to cut into uneven bands
    whole = tr.apply(x)
    for bands in ([(0, 4), (4, 9), (9, 15)], [(0, 1), (1, 15)], [(i, i + 1) for i in range(15)]):
        assert torch.equal(torch.cat([tr.apply(x[a:b]) for a, b in bands]), whole)


def test_which_are_row_local():
    assert {t for t in Transform if t.row_local} == {Transform.SQUEEZE, Transform.UNSQUEEZE}
    assert {t for t in Transform if not t.keeps_rows} == {Transform.TRANSPOSE} | REGROUPING


@pytest.mark.parametrize("tr", sorted(REGROUPING))
def test_regrouping_ones_have_no_factors(tr):
    with pytest.raises(ValueError, match="no LoRA factors"):
        tr.factors(torch.zeros(6, 1), torch.zeros(1, 3))


@pytest.mark.parametrize("tr", [t for t in Transform if t not in REGROUPING])
def test_factors_carry_the_product(tr):
    """lora convert moves factors across a transform without forming the delta; lora extract cuts the
    delta's row view (`on_rows`): the two must agree."""
    rows, cols = (6, 5) if tr is not Transform.TRANSPOSE else (4, 7)
    up, down = torch.randn(rows, 3, dtype=torch.float64), torch.randn(3, cols, dtype=torch.float64)
    u, d = tr.factors(up, down)
    assert u.shape[1] == d.shape[0] == 3
    assert torch.equal(u @ d, tr.on_rows(up @ down))


@pytest.mark.parametrize("tr", [Transform.SWAP_HALVES])
def test_bias_follows_the_rows(tr):
    b = torch.arange(6.0)
    assert torch.equal(tr.on_bias(b), torch.tensor([3.0, 4, 5, 0, 1, 2]))


@pytest.mark.parametrize("tr", [Transform.TRANSPOSE, Transform.SQUEEZE, Transform.UNSQUEEZE])
def test_bias_stays_where_rows_do_not_move(tr):
    b = torch.arange(6.0)
    assert tr.on_bias(b) is b


@pytest.mark.parametrize("tr, shape", [(Transform.SWAP_HALVES, (5, 4)), (Transform.SWAP_HALVES, ()),
                                       (Transform.TRANSPOSE, (2, 3, 4)), (Transform.TRANSPOSE, (3,)),
                                       (Transform.SQUEEZE, (4, 3, 3, 3)), (Transform.UNSQUEEZE, (4, 3, 1, 1)),
                                       (Transform.SIX_ROWS, (20,)), (Transform.SIX_ROWS, (6, 3))])
def test_shapes_it_cannot_take(tr, shape):
    with pytest.raises(ValueError):
        tr.shape(shape)


def test_odd_rows_message():
    """convert --layout prints it after the tensor's name."""
    with pytest.raises(ValueError, match="^5 rows cannot be split in two halves$"):
        Transform.SWAP_HALVES.row_spans(5)
    with pytest.raises(ValueError, match="^1 row cannot"):
        Transform.SWAP_HALVES.apply(torch.zeros(1, 2))


def test_families_declare_it_by_name():
    """Family modules write the name; Pair and Alias hold the member, equal to the name (tables, JSON)."""
    p = Pair("final_layer.adaLN_modulation.1.weight", "norm_out.linear.weight", transform="swap_halves")
    assert p.transform is Transform.SWAP_HALVES and p.transform == "swap_halves"
    assert hash(p.transform) == hash("swap_halves") and f"{p.transform}" == "swap_halves"
    assert p == Pair(p.original, p.diffusers, transform=Transform.SWAP_HALVES)
    assert Alias("a", "b.weight", transform="transpose").transform is Transform.TRANSPOSE
    assert Pair("a", "b").transform is None
    with pytest.raises(ValueError):
        Pair("a", "b", transform="flip")
