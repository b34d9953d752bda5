"""`ckpt merge` passthrough and slices (layer stacking, per-slice merges) against mergekit."""

from __future__ import annotations

import json

from transformers import AutoModelForCausalLM

from helpers.merge_oracle import same_yaml, tiny_llama, variants


def test_passthrough_slices_stack_layers_as_mergekit(run_ckpt, tmp_path):
    a = tiny_llama(tmp_path / "a", 1, layers=4)
    b = tiny_llama(tmp_path / "b", 2, layers=4)
    _, out = same_yaml(run_ckpt, tmp_path, f"""merge_method: passthrough
slices:
  - sources:
      - model: {a}
        layer_range: [0, 3]
  - sources:
      - model: {b}
        layer_range: [1, 4]
dtype: float32
""")
    assert sum(k.endswith("self_attn.q_proj.weight") for k in out) == 6
    cfg = json.loads((tmp_path / "out_ckpt" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 6
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out_ckpt")  # loads: every weight present
    assert model.config.num_hidden_layers == 6


def test_slerp_free_slices_with_linear_and_scale(run_ckpt, tmp_path):
    ms = variants(tmp_path, 3)
    same_yaml(run_ckpt, tmp_path, f"""merge_method: linear
slices:
  - sources:
      - model: {ms[0]}
        layer_range: [0, 2]
        parameters: {{weight: 0.3}}
      - model: {ms[1]}
        layer_range: [2, 4]
        parameters: {{weight: [0.2, 0.9]}}
  - sources:
      - model: {ms[2]}
        layer_range: [1, 3]
        parameters: {{weight: 1.0}}
      - model: {ms[0]}
        layer_range: [1, 3]
        parameters: {{weight: 0.5}}
parameters:
  normalize: true
dtype: float32
""")


def test_passthrough_scale_by_filter(run_ckpt, tmp_path):
    a = tiny_llama(tmp_path / "a", 1, layers=3)
    same_yaml(run_ckpt, tmp_path, f"""merge_method: passthrough
slices:
  - sources:
      - model: {a}
        layer_range: [0, 3]
        parameters:
          scale:
            - filter: o_proj
              value: 0.5
            - filter: down_proj
              value: [0.0, 1.0]
            - value: 1.0
dtype: float32
""")
