"""`ckpt merge` linear and the recipe machinery (gradients, filters, per-model settings) against mergekit."""

from __future__ import annotations

from helpers.merge_oracle import same_yaml, variants


def test_linear_with_gradient_and_filters_equals_mergekit(run_ckpt, tmp_path):
    ms = variants(tmp_path, 3)
    same_yaml(run_ckpt, tmp_path, f"""merge_method: linear
models:
  - model: {ms[0]}
    parameters: {{weight: 0.5}}
  - model: {ms[1]}
    parameters: {{weight: [0.2, 1.0, 0.3]}}
  - model: {ms[2]}
    parameters:
      weight:
        - filter: mlp
          value: 0.7
        - value: [0.1, 0.4]
dtype: float32
""")


def test_tied_qwen_gqa_output_loads_strictly(run_ckpt, tmp_path):
    from transformers import Qwen2ForCausalLM

    from helpers.llm import load_strict
    from helpers.merge_oracle import tiny_llama

    a = tiny_llama(tmp_path / "a", 1, qwen=True, tied=True, kv_heads=1)
    b = tiny_llama(tmp_path / "b", 2, qwen=True, tied=True, kv_heads=1)
    same_yaml(run_ckpt, tmp_path, f"""merge_method: linear
models:
  - model: {a}
    parameters: {{weight: 1.0}}
  - model: {b}
    parameters: {{weight: [1.0, 3.0]}}
dtype: float32
""")
    load_strict(tmp_path / "out_ckpt", Qwen2ForCausalLM)


def test_flux_keyed_files_equal_mergekit_pytorch(run_ckpt, tmp_path):
    import torch
    from safetensors.torch import save_file

    from helpers.merge_oracle import same_yaml_raw

    keys = {"double_blocks.0.img_attn.qkv.weight": (24, 8), "double_blocks.1.img_mlp.0.weight": (16, 8),
            "single_blocks.0.linear1.weight": (40, 8), "img_in.weight": (8, 4), "final_layer.linear.bias": (4,)}
    paths = []
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        p = tmp_path / f"f{i}.safetensors"
        save_file({k: torch.randn(s, generator=g).to(torch.bfloat16) for k, s in keys.items()}, p)
        paths.append(p)
    same_yaml_raw(run_ckpt, tmp_path, f"""merge_method: linear
models:
  - model: {paths[0]}
    parameters: {{weight: [{{filter: double_blocks, value: 0.2}}, {{value: 0.5}}]}}
  - model: {paths[1]}
    parameters: {{weight: 0.3}}
  - model: {paths[2]}
    parameters: {{weight: 0.1}}
dtype: float32
out_dtype: bfloat16
""")
