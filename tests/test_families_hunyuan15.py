"""HunyuanVideo 1.5's correspondence, for which diffusers ships no single-file converter.

The table is diffusers' conversion script (`scripts/convert_hunyuan_video1_5_to_diffusers.py`, not in the
wheel) read against Tencent's and ComfyUI's model code. What can be checked here is checked:
- every module 1.5 shares with HunyuanVideo 1.x (token refiner, double-block modulations, MLPs, norms,
  output projections, the final adaLN) pairs with the same Tencent name as in 1.x, whose table diffusers'
  1.x converter verifies bit for bit (tests/test_families.py);
- the table covers the diffusers model class exactly: every tensor of a tiny HunyuanVideo15Transformer3DModel
  (MeanFlow too) has one Tencent name, and back;
- both layouts and kohya-flattened LoRA names are recognised, and told from 1.x and Flux.1.
"""

from __future__ import annotations

import pytest
import torch

from families_util import (diffusers_from_pairs, original_from_pairs, shapes, state_dict, tiny_hunyuan_video,
                           tiny_hunyuan_video15, unique_values)
from ckpt import families
from ckpt.families import DIFFUSERS, ORIGINAL

pytest.importorskip("diffusers")

NEW_IN_15 = ("time_embed.", "context_embedder_2.", "image_embedder.", "cond_type_embed.")


@pytest.mark.parametrize("meanflow", [False, True])
def test_table_covers_the_model_class_both_ways(meanflow):
    fam = families.get("hunyuan_video15")
    sd = unique_values(state_dict(tiny_hunyuan_video15(meanflow)))
    original = original_from_pairs(fam, sd)
    assert len(original) == len(sd) - 4  # the refiner: q, k, v weights and biases fused into one of each
    assert ("time_r_in.mlp.0.weight" in original) == meanflow
    back = diffusers_from_pairs(fam, original)
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)


def test_shared_modules_have_hunyuan_video_1x_names():
    v15, v1 = families.get("hunyuan_video15"), families.get("hunyuan_video")
    sd15 = shapes(state_dict(tiny_hunyuan_video15()))
    one = {p.diffusers: p for p in v1.pairs(shapes(state_dict(tiny_hunyuan_video())), DIFFUSERS)}
    shared = 0
    for p in v15.pairs(sd15, DIFFUSERS):
        q = one.get(p.diffusers)
        if q is None:
            assert p.diffusers.startswith(NEW_IN_15), p
        elif q.rows is not None and p.rows is None and q.original.startswith("double_blocks."):
            # 1.5 keeps the double blocks' q, k, v apart: `img_attn_q` is rows [0, H) of 1.x's `img_attn_qkv`
            letter = "qkv"[q.rows[0] // (q.rows[1] - q.rows[0])]
            assert p.original == q.original.replace("_attn_qkv", f"_attn_{letter}"), p
            shared += 1
        else:
            assert (p.original, p.rows, p.transform) == (q.original, q.rows, q.transform), p
            shared += 1
    assert shared == len(sd15) - 21  # all but the 21 tensors of the modules new in 1.5


def test_both_layouts_and_kohya_names_are_recognised():
    fam = families.get("hunyuan_video15")
    sd = shapes(state_dict(tiny_hunyuan_video15()))
    original = shapes(original_from_pairs(fam, unique_values(state_dict(tiny_hunyuan_video15()))))
    for layout, keys in ((ORIGINAL, original), (DIFFUSERS, sd)):
        m = families.detect(keys, keys)
        assert (m.family_id, m.layout) == ("hunyuan_video15", layout), m
        flat = [k.rsplit(".", 1)[0].replace(".", "_") for k in keys if k.endswith(".weight")]
        m2 = families.detect(flat)
        assert (m2.family_id, m2.layout) == ("hunyuan_video15", layout), m2
    # a musubi LoRA on the double blocks only: separate q/k/v say 1.5, not 1.x or Flux.1
    lora = [f"double_blocks_{i}_{s}_{m}" for i in range(2) for s in ("img", "txt")
            for m in ("attn_q", "attn_k", "attn_v", "attn_proj", "mlp_fc1", "mod_linear")]
    assert families.detect(lora).family_id == "hunyuan_video15"
    assert families.from_config({"_class_name": "HunyuanVideo15Transformer3DModel"}) is fam
