"""What a refused input looks like from the CLI: exit 2, one `error: CULPRIT...` line naming the problem,
and the folder's listing unchanged (nothing written, nothing removed)."""

from __future__ import annotations

import json


def assert_refused(run_ckpt, tmp_path, args, culprit, problem):
    before = sorted(p.name for p in tmp_path.rglob("*"))
    code, out, err = run_ckpt(*args)
    assert code == 2, (code, out, err)
    assert err.count("\n") == 1 and err.startswith(f"error: {culprit}"), err
    assert problem in err, err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def edit_saved(folder, tensors=None, drop=(), qc=None, config=None, quant=None):
    """Break a saved quantized folder for a bad-input case: replace/add tensors in model.safetensors, drop keys,
    update config.json's `quantization_config` entries (`qc`) or its top-level ones (`config`), or the
    `quantization` entries of ModelOpt's hf_quant_config.json (`quant`)."""
    from safetensors.torch import load_file, save_file

    sd = load_file(folder / "model.safetensors")
    for k in drop:
        del sd[k]
    sd.update(tensors or {})
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    for name, key, changes in (("config.json", "quantization_config", qc), ("config.json", None, config),
                               ("hf_quant_config.json", "quantization", quant)):
        if changes:
            cfg = json.loads((folder / name).read_text())
            (cfg if key is None else cfg[key]).update(changes)
            (folder / name).write_text(json.dumps(cfg))
