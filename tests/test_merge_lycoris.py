"""LyCORIS families, kohya LoCon and XLabs: adapter files written in the test from the format
definitions (docs/format-facts.md "LoRA family"), merged by the real CLI, compared with the formula computed
here (or, for convolutions, with the adapter's own forward pass run through torch's conv2d).

Everything is fp32 end to end, so the only differences are summation order: rtol 1e-5 / atol 1e-5.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

TOL = dict(rtol=1e-5, atol=1e-5)


def rnd(*shape, seed=[0]):
    seed[0] += 1
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed[0]))


def base_file(tmp_path, tensors):
    p = tmp_path / "base.safetensors"
    save_file(tensors, p)
    return p


def merge(tmp_path, run_ckpt, base, lora_tensors, *extra, name="lora.safetensors"):
    lora = tmp_path / name
    save_file(lora_tensors, lora)
    out = tmp_path / "out.safetensors"
    code, stdout, err = run_ckpt("merge-lora", base, lora, "-o", out, "-q", "--overwrite", *extra)
    assert code == 0, err
    return load_file(out), stdout


def test_locon_conv3x3_matches_forward_pass(tmp_path, run_ckpt):
    W, down, up = rnd(6, 4, 3, 3), rnd(2, 4, 3, 3), rnd(6, 2, 1, 1)
    base = base_file(tmp_path, {"conv.weight": W, "conv.bias": rnd(6)})
    got, _ = merge(tmp_path, run_ckpt, base, {"conv.lora_down.weight": down, "conv.lora_up.weight": up,
                                              "conv.alpha": torch.tensor(1.0)})
    x = rnd(1, 4, 7, 7)
    want = F.conv2d(x, W, padding=1) + 0.5 * F.conv2d(F.conv2d(x, down, padding=1), up)
    torch.testing.assert_close(F.conv2d(x, got["conv.weight"], padding=1), want, rtol=1e-4, atol=1e-4)


def test_locon_tucker_mid_matches_forward_pass(tmp_path, run_ckpt):
    W, down, mid, up = rnd(6, 4, 3, 3), rnd(3, 4, 1, 1), rnd(3, 3, 3, 3), rnd(6, 3, 1, 1)
    base = base_file(tmp_path, {"conv.weight": W})
    got, _ = merge(tmp_path, run_ckpt, base, {"conv.lora_down.weight": down, "conv.lora_mid.weight": mid,
                                              "conv.lora_up.weight": up, "conv.alpha": torch.tensor(6.0)})
    x = rnd(1, 4, 7, 7)
    lora_out = F.conv2d(F.conv2d(F.conv2d(x, down), mid, padding=1), up)
    want = F.conv2d(x, W, padding=1) + 2.0 * lora_out
    torch.testing.assert_close(F.conv2d(x, got["conv.weight"], padding=1), want, rtol=1e-4, atol=1e-4)


def test_loha_linear_and_tucker(tmp_path, run_ckpt):
    W, C = rnd(8, 6), rnd(5, 3, 3, 3)
    w1a, w1b, w2a, w2b = rnd(8, 2), rnd(2, 6), rnd(8, 2), rnd(2, 6)
    t1, t2, c1a, c1b, c2a, c2b = rnd(2, 2, 3, 3), rnd(2, 2, 3, 3), rnd(2, 5), rnd(2, 3), rnd(2, 5), rnd(2, 3)
    base = base_file(tmp_path, {"lin.weight": W, "conv.weight": C})
    got, _ = merge(tmp_path, run_ckpt, base, {
        "lin.hada_w1_a": w1a, "lin.hada_w1_b": w1b, "lin.hada_w2_a": w2a, "lin.hada_w2_b": w2b,
        "lin.alpha": torch.tensor(1.0),
        "conv.hada_w1_a": c1a, "conv.hada_w1_b": c1b, "conv.hada_w2_a": c2a, "conv.hada_w2_b": c2b,
        "conv.hada_t1": t1, "conv.hada_t2": t2, "conv.alpha": torch.tensor(4.0)})
    torch.testing.assert_close(got["lin.weight"], W + 0.5 * (w1a @ w1b) * (w2a @ w2b), **TOL)
    # Tucker: w[p, r, k, l] = sum_ij t[i, j, k, l] wa[i, p] wb[j, r]
    r1 = (t1[:, :, None, None] * c1a[:, None, :, None, None, None] * c1b[None, :, None, :, None, None]).sum((0, 1))
    r2 = (t2[:, :, None, None] * c2a[:, None, :, None, None, None] * c2b[None, :, None, :, None, None]).sum((0, 1))
    torch.testing.assert_close(got["conv.weight"], C + 2.0 * r1 * r2, **TOL)


def test_lokr_scale_once_full_factors_scale_one_and_tucker(tmp_path, run_ckpt):
    A, B, C = rnd(12, 6), rnd(12, 6), rnd(4, 6, 3, 3)
    w1 = rnd(3, 2)
    w2a, w2b = rnd(4, 2), rnd(2, 3)
    full1, full2 = rnd(3, 2), rnd(4, 3)
    cw1, t2, cw2a, cw2b = rnd(2, 2), rnd(2, 2, 3, 3), rnd(2, 2), rnd(2, 3)
    base = base_file(tmp_path, {"a.weight": A, "b.weight": B, "c.weight": C})
    got, _ = merge(tmp_path, run_ckpt, base, {
        "a.lokr_w1": w1, "a.lokr_w2_a": w2a, "a.lokr_w2_b": w2b, "a.alpha": torch.tensor(1.0),
        "b.lokr_w1": full1, "b.lokr_w2": full2, "b.alpha": torch.tensor(7.0),  # both full: scale 1
        "c.lokr_w1": cw1, "c.lokr_w2_a": cw2a, "c.lokr_w2_b": cw2b, "c.lokr_t2": t2, "c.alpha": torch.tensor(1.0)})
    torch.testing.assert_close(got["a.weight"], A + 0.5 * torch.kron(w1, w2a @ w2b), **TOL)
    torch.testing.assert_close(got["b.weight"], B + torch.kron(full1, full2), **TOL)
    w2 = torch.einsum("ijkl,ip,jr->prkl", t2, cw2a, cw2b).contiguous()  # [2, 3, 3, 3]
    want = torch.kron(cw1[:, :, None, None], w2)  # [4, 6, 3, 3]
    torch.testing.assert_close(got["c.weight"], C + 0.5 * want, **TOL)


def test_full_diff_ia3_and_glora(tmp_path, run_ckpt):
    F_, Fb, I_out, I_in, G = rnd(5, 4), rnd(5), rnd(6, 4), rnd(6, 4), rnd(6, 4)
    diff, diff_b, v_out, v_in = rnd(5, 4), rnd(5), rnd(6), rnd(4)
    a1, a2, b1, b2 = rnd(4, 2), rnd(2, 4), rnd(6, 2), rnd(2, 4)
    base = base_file(tmp_path, {"f.weight": F_, "f.bias": Fb, "io.weight": I_out, "ii.weight": I_in, "g.weight": G})
    got, _ = merge(tmp_path, run_ckpt, base, {
        "f.diff": diff, "f.diff_b": diff_b,
        "io.weight": v_out, "io.on_input": torch.tensor(False),
        "ii.weight": v_in, "ii.on_input": torch.tensor(True),
        "g.a1.weight": a1, "g.a2.weight": a2, "g.b1.weight": b1, "g.b2.weight": b2, "g.alpha": torch.tensor(1.0),
    }, "--ratio", "0.5")
    torch.testing.assert_close(got["f.weight"], F_ + 0.5 * diff, **TOL)
    torch.testing.assert_close(got["f.bias"], Fb + 0.5 * diff_b, **TOL)
    torch.testing.assert_close(got["io.weight"], I_out * (1 + 0.5 * v_out)[:, None], **TOL)
    torch.testing.assert_close(got["ii.weight"], I_in * (1 + 0.5 * v_in)[None, :], **TOL)
    torch.testing.assert_close(got["g.weight"], G + 0.5 * 0.5 * (G @ a1 @ a2 + b1 @ b2), **TOL)


def dora_ref(W, dW, m, axis):
    V = W + dW
    n = V.norm(dim=1, keepdim=True) if axis == "out" else V.transpose(0, 1).reshape(V.shape[1], -1).norm(dim=1).reshape(1, -1, *[1] * (V.dim() - 2))
    return m * V / n


def test_dora_scale_both_axes(tmp_path, run_ckpt):
    W1, W2, C = rnd(6, 4), rnd(6, 4), rnd(6, 4, 3, 3)
    d1, u1, d2, u2, cd, cu = rnd(2, 4), rnd(6, 2), rnd(2, 4), rnd(6, 2), rnd(2, 4, 3, 3), rnd(6, 2, 1, 1)
    m_out, m_in, m_conv = rnd(6, 1).abs(), rnd(1, 4).abs(), rnd(1, 4, 1, 1).abs()
    base = base_file(tmp_path, {"o.weight": W1, "i.weight": W2, "c.weight": C})
    got, _ = merge(tmp_path, run_ckpt, base, {
        "o.lora_down.weight": d1, "o.lora_up.weight": u1, "o.dora_scale": m_out,
        "i.lora_down.weight": d2, "i.lora_up.weight": u2, "i.dora_scale": m_in, "i.alpha": torch.tensor(1.0),
        "c.lora_down.weight": cd, "c.lora_up.weight": cu, "c.dora_scale": m_conv})
    torch.testing.assert_close(got["o.weight"], dora_ref(W1, u1 @ d1, m_out, "out"), **TOL)
    torch.testing.assert_close(got["i.weight"], dora_ref(W2, 0.5 * u2 @ d2, m_in, "in"), **TOL)
    dC = (cu.flatten(1) @ cd.flatten(1)).reshape(C.shape)
    torch.testing.assert_close(got["c.weight"], dora_ref(C, dC, m_conv, "in"), **TOL)


def test_dora_ratio_interpolates(tmp_path, run_ckpt):
    W, d, u, m = rnd(6, 4), rnd(2, 4), rnd(6, 2), rnd(6, 1).abs()
    base = base_file(tmp_path, {"o.weight": W})
    got, _ = merge(tmp_path, run_ckpt, base, {"o.lora_down.weight": d, "o.lora_up.weight": u, "o.dora_scale": m},
                   "--ratio", "0.25")
    torch.testing.assert_close(got["o.weight"], W + 0.25 * (dora_ref(W, u @ d, m, "out") - W), **TOL)


def test_xlabs_flux_double_blocks(tmp_path, run_ckpt):
    H = 8
    base_t = {"double_blocks.0.img_attn.qkv.weight": rnd(3 * H, H), "double_blocks.0.txt_attn.proj.weight": rnd(H, H),
              "double_blocks.0.img_attn.qkv.bias": rnd(3 * H)}
    base = base_file(tmp_path, base_t)
    d1, u1, d2, u2 = rnd(2, H), rnd(3 * H, 2), rnd(2, H), rnd(H, 2)
    got, out = merge(tmp_path, run_ckpt, base, {
        "double_blocks.0.processor.qkv_lora1.down.weight": d1, "double_blocks.0.processor.qkv_lora1.up.weight": u1,
        "double_blocks.0.processor.proj_lora2.down.weight": d2, "double_blocks.0.processor.proj_lora2.up.weight": u2})
    torch.testing.assert_close(got["double_blocks.0.img_attn.qkv.weight"],
                               base_t["double_blocks.0.img_attn.qkv.weight"] + u1 @ d1, **TOL)
    torch.testing.assert_close(got["double_blocks.0.txt_attn.proj.weight"],
                               base_t["double_blocks.0.txt_attn.proj.weight"] + u2 @ d2, **TOL)
    assert torch.equal(got["double_blocks.0.img_attn.qkv.bias"], base_t["double_blocks.0.img_attn.qkv.bias"])
    assert "2 LoRA modules matched" in out


def test_old_diffusers_spellings(tmp_path, run_ckpt):
    q, o, p = rnd(4, 4), rnd(4, 4), rnd(4, 4)
    base = base_file(tmp_path, {"attn1.to_q.weight": q, "attn1.to_out.0.weight": o, "proj_in.weight": p})
    dq, uq, do, uo, dp, up = rnd(2, 4), rnd(4, 2), rnd(2, 4), rnd(4, 2), rnd(2, 4), rnd(4, 2)
    got, _ = merge(tmp_path, run_ckpt, base, {
        "attn1.processor.to_q_lora.down.weight": dq, "attn1.processor.to_q_lora.up.weight": uq,
        "attn1.processor.to_out_lora.down.weight": do, "attn1.processor.to_out_lora.up.weight": uo,
        "proj_in.lora.down.weight": dp, "proj_in.lora.up.weight": up})
    torch.testing.assert_close(got["attn1.to_q.weight"], q + uq @ dq, **TOL)
    torch.testing.assert_close(got["attn1.to_out.0.weight"], o + uo @ do, **TOL)
    torch.testing.assert_close(got["proj_in.weight"], p + up @ dp, **TOL)


def test_row_bands_equal_whole_reads():
    """MergedTensor read band by band gives the same rows as one whole read (every row-local family)."""
    from ckpt.io.tensors import ComputedTensor
    from ckpt.adapters.kinds import make_adapter
    from ckpt.adapters.loading import group_modules
    from ckpt.adapters.merged import MergedTensor, Patch

    W = rnd(12, 6)
    parts = {"l.lora_down.weight": rnd(2, 6), "l.lora_up.weight": rnd(12, 2), "l.dora_scale": rnd(12, 1).abs(),
             "h.hada_w1_a": rnd(12, 2), "h.hada_w1_b": rnd(2, 6), "h.hada_w2_a": rnd(12, 2), "h.hada_w2_b": rnd(2, 6),
             "k.lokr_w1": rnd(3, 2), "k.lokr_w2": rnd(4, 3),
             "g.a1.weight": rnd(6, 2), "g.a2.weight": rnd(2, 6), "g.b1.weight": rnd(12, 2), "g.b2.weight": rnd(2, 6)}
    stored = {k: ComputedTensor(k, lambda v=v: v, v.dtype, v.shape) for k, v in parts.items()}
    modules, unknown = group_modules(stored, "t", {}, False)
    assert not unknown
    class Rows(ComputedTensor):
        row_align = 1

        def read(self, start, stop, device, out=None):
            return W[start:stop].to(device)

    base = Rows("w", lambda: W, W.dtype, W.shape)
    cpu = torch.device("cpu")
    for m in modules.values():
        mt = MergedTensor(base, [Patch(make_adapter(m), 0.7)])
        assert mt.row_align == 1
        whole = mt.read(0, 12, cpu).clone()
        banded = torch.cat([mt.read(a, min(12, a + 5), cpu).clone() for a in range(0, 12, 5)])
        torch.testing.assert_close(banded, whole, rtol=1e-6, atol=1e-6, msg=m.name)


def test_malformed_family_weights_are_one_line_errors(tmp_path, run_ckpt):
    base = base_file(tmp_path, {"lin.weight": rnd(8, 6)})
    cases = [{"lin.hada_w1_a": rnd(8), "lin.hada_w1_b": torch.tensor(1.0), "lin.hada_w2_a": rnd(8, 2), "lin.hada_w2_b": rnd(2, 6)},
             {"lin.lokr_w1_a": rnd(2, 2)},
             {"lin.a1.weight": rnd(6, 2), "lin.a2.weight": rnd(3, 6), "lin.b1.weight": rnd(8, 2), "lin.b2.weight": rnd(2, 6)},
             {"lin.diff": rnd(8, 5)},
             {"lin.lora_down.weight": rnd(2, 6), "lin.lora_up.weight": rnd(8, 2), "lin.dora_scale": rnd(5, 1)}]
    for i, tensors in enumerate(cases):
        lora = tmp_path / f"bad{i}.safetensors"
        save_file(tensors, lora)
        code, _, err = run_ckpt("merge-lora", base, lora, "-o", tmp_path / "o.safetensors")
        assert code == 2 and err.startswith("error:") and f"bad{i}.safetensors" in err, err
        assert len(err.strip().splitlines()) == 1 and not (tmp_path / "o.safetensors").exists()
