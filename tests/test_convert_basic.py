"""End-to-end convert of a plain safetensors file against torch's own casts."""

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file


def test_convert_plain_file_matches_torch_casts(tmp_path, run_ckpt):
    src = tmp_path / "m.safetensors"
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a.weight": torch.randn(300, 70, generator=g),
        "a.bias": torch.randn(70, generator=g).half(),
        "steps": torch.arange(5),
        "f8": torch.randn(33, 3, generator=g).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(3.5, dtype=torch.bfloat16),
    }
    save_file(tensors, src, metadata={"modelspec.title": "tiny"})
    code, out, err = run_ckpt("convert", src, "--to", "fp16", "-q")
    assert code == 0, err
    dst = tmp_path / "m-fp16.safetensors"
    got = load_file(dst)
    assert set(got) == set(tensors)
    for k, v in tensors.items():
        want = v.to(torch.float16) if v.is_floating_point() else v
        assert got[k].dtype == want.dtype and torch.equal(got[k].view(-1).view(torch.uint8) if got[k].numel() else got[k],
                                                          want.view(-1).view(torch.uint8) if want.numel() else want), k
    with safe_open(dst, "pt") as f:
        meta = f.metadata()
    assert meta["modelspec.title"] == "tiny" and meta["ckpt_operation"] == "convert --to fp16"
