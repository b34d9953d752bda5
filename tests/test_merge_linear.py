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
