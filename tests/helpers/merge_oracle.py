"""mergekit and sd-mecha as oracles of `ckpt merge`, and the tiny models they merge.

mergekit (LGPL-3.0) is run, never copied: in-process through its own API (`run_merge`, the code `mergekit-yaml`
runs; `mergekit-pytorch`'s raw-safetensors planner for Flux/SDXL-keyed files), which saves each test the
5 s start-up of a fresh `mergekit-yaml` process. `same_yaml` runs one YAML text through both and compares every
tensor.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def tiny_llama(path: Path, seed: int, *, scale: float = 0.02, layers: int = 4, tied: bool = False,
               kv_heads: int = 2, qwen: bool = False, dtype=torch.float32) -> Path:
    """A tiny Llama (or Qwen2: q/k/v biases) transformers folder with random weights; GQA when kv_heads < 4."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
              num_key_value_heads=kv_heads, tie_word_embeddings=tied)
    model = Qwen2ForCausalLM(Qwen2Config(**kw)) if qwen else LlamaForCausalLM(LlamaConfig(**kw))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, scale)
    with contextlib.redirect_stderr(io.StringIO()):  # transformers' "Writing model shards" bar
        model.to(dtype).save_pretrained(path)
    return path


def variants(root: Path, n: int = 3, **kw) -> list[Path]:
    """A base `m0` and fine-tunes `m1..` that differ from it by small deltas (what task arithmetic expects)."""
    base = tiny_llama(root / "m0", 0, **kw)
    out = [base]
    sd = load_file(base / "model.safetensors")
    cfg = json.loads((base / "config.json").read_text())
    for i in range(1, n):
        g = torch.Generator().manual_seed(100 + i)
        d = root / f"m{i}"
        d.mkdir()
        save_file({k: (v.float() + 0.01 * torch.randn(v.shape, generator=g)).to(v.dtype) for k, v in sd.items()},
                  d / "model.safetensors", metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps(cfg))
        out.append(d)
    return out


def mergekit_yaml(config_text: str, out: Path, *, seed: int | None = None) -> Path:
    """What `mergekit-yaml CONFIG OUT` writes, run in-process."""
    import yaml
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    cfg = MergeConfiguration.model_validate(yaml.safe_load(config_text))
    opts = MergeOptions(copy_tokenizer=False, lazy_unpickle=False, low_cpu_memory=False, quiet=True,
                        random_seed=seed, lora_merge_cache=str(Path(out).parent / "mergekit_lora_cache"))
    run_merge(cfg, str(out), options=opts)
    return out


def tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file or folder (shards merged)."""
    path = Path(path)
    if path.is_file():
        return load_file(path)
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:5]
    worst = 0.0
    for k in a:
        assert a[k].shape == b[k].shape and a[k].dtype == b[k].dtype, (k, a[k].shape, b[k].shape, a[k].dtype, b[k].dtype)
        worst = max(worst, (a[k].double() - b[k].double()).abs().max().item() if a[k].numel() else 0.0)
    return worst


def same_yaml(run_ckpt, tmp_path: Path, config_text: str, *, tol: float = 0.0, extra=(), seed=None) -> tuple[dict, dict]:
    """Run one YAML config through mergekit and `ckpt merge`; assert every tensor agrees within `tol` (absolute);
    returns (mergekit's tensors, ckpt's)."""
    return _same(run_ckpt, tmp_path, config_text, mergekit_yaml(config_text, tmp_path / "out_mergekit", seed=seed),
                 tmp_path / "out_ckpt", tol, extra)


def _same(run_ckpt, tmp_path: Path, config_text: str, ref: Path, out: Path, tol: float, extra) -> tuple[dict, dict]:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(config_text)
    code, o, err = run_ckpt("merge", cfg, "-o", out, "-q", *extra)
    assert code == 0, (o, err)
    a, b = tensors(ref), tensors(out)
    d = max_diff(a, b)
    assert d <= tol, (d, tol)
    return a, b


def mergekit_pytorch(config_text: str, out: Path, *, seed: int | None = None) -> Path:
    """What `mergekit-pytorch CONFIG OUT` writes (raw safetensors files, no architecture), run in-process."""
    import yaml
    from mergekit.graph import Executor
    from mergekit.options import MergeOptions
    from mergekit.scripts.merge_raw_pytorch import RawPyTorchMergeConfig, plan_flat_merge

    if seed is not None:
        torch.manual_seed(seed)
    cfg = RawPyTorchMergeConfig.model_validate(yaml.safe_load(config_text))
    opts = MergeOptions(quiet=True, random_seed=seed)
    Executor(plan_flat_merge(cfg, str(out), False, False, opts), math_device="cpu", storage_device="cpu").execute()
    return out


def same_yaml_raw(run_ckpt, tmp_path: Path, config_text: str, *, tol: float = 0.0, extra=()) -> tuple[dict, dict]:
    """`same_yaml` with mergekit-pytorch as the oracle (raw safetensors inputs such as Flux/SDXL-keyed files)."""
    return _same(run_ckpt, tmp_path, config_text, mergekit_pytorch(config_text, tmp_path / "out_mergekit"),
                 tmp_path / "out_ckpt.safetensors", tol, extra)
