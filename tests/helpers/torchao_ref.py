"""torchao 0.18 as a test oracle, kept out of the test process.

torchao is installed once with `pip install --no-deps --target` into `.venv/torchao-ref/` (git-ignored, kept
between runs; `CKPT_TORCHAO_REF` names another folder), never into the venv itself: importing torchao there
makes PEFT log warnings on stderr, which other tests read. Each reference folder is made by a subprocess with
that folder on PYTHONPATH, so no test in this process ever imports torchao.

`build(folder, config, dtype)`: a tiny LlamaForCausalLM (no downloads) saved plain, loaded back through
transformers with `TorchAoConfig(<config>)` (transformers runs torchao's `quantize_` on each Linear), saved with
`save_pretrained(safe_serialization=True)` (transformers flattens the tensor subclasses with torchao's
`flatten_tensor_state_dict`; transformers 5.24 writes safetensors whatever `safe_serialization` says, so the
pickled form, `safetensors=False`, is `torch.save(model.state_dict())`), and `reference.safetensors` beside it: `weight.dequantize()` of every
quantized parameter, torchao's own dequantization, plus the subclass names. Tests skip with the reason
when the registry cannot be reached.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

VERSION = "0.18.0"
REPO = Path(__file__).resolve().parents[2]


class Unavailable(RuntimeError):
    """torchao cannot be installed here (no registry): tests skip with this reason."""


def folder() -> Path:
    """The folder torchao is installed in, installed on first use."""
    root = Path(os.environ.get("CKPT_TORCHAO_REF") or REPO / ".venv" / "torchao-ref")
    if not (root / "torchao" / "__init__.py").exists():
        root.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(root),
                            f"torchao=={VERSION}"], capture_output=True, text=True)
        if r.returncode != 0 or not (root / "torchao" / "__init__.py").exists():
            raise Unavailable(f"pip install --target {root} torchao=={VERSION} failed: {r.stderr.strip()[-200:]}")
    return root


SCRIPT = r"""
import json, sys, torch, transformers
from safetensors.torch import save_file
from torchao.quantization import *  # the config expression names its classes
from torchao.quantization.granularity import PerAxis, PerGroup, PerRow, PerTensor
from torchao.quantization.quant_primitives import MappingType

out, config, dtype, tie = sys.argv[1], eval(sys.argv[2]), getattr(torch, sys.argv[3]), sys.argv[4] == "1"
cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                               tie_word_embeddings=tie)
torch.manual_seed(0)
transformers.LlamaForCausalLM(cfg).to(dtype).save_pretrained(out + "/plain")
model = transformers.AutoModelForCausalLM.from_pretrained(
    out + "/plain", dtype=dtype, quantization_config=transformers.TorchAoConfig(config))
model.save_pretrained(out + "/q")
if sys.argv[5] == "0":  # the state dict pickled whole, tensor subclasses and all (torch.save)
    import os
    os.remove(out + "/q/model.safetensors")
    torch.save(model.state_dict(), out + "/q/pytorch_model.bin")
ref, kinds = {}, {}
for name, p in model.named_parameters():
    if type(p) is not torch.nn.Parameter and type(p).__name__ != "Tensor":
        ref[name] = p.dequantize().contiguous()
        kinds[name] = type(p).__name__
save_file(ref, out + "/reference.safetensors", metadata={"kinds": json.dumps(kinds)})
"""


def build(out: Path, config: str, dtype: str = "bfloat16", tie: bool = False, safetensors: bool = True):
    """Make `out/q` (the torchao save) and `out/reference.safetensors`; returns (reference tensors, their
    subclass names)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(folder())
    env["HF_HUB_OFFLINE"] = "1"
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(out), config, dtype, "1" if tie else "0",
                        "1" if safetensors else "0"], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"torchao reference for {config} failed:\n{r.stderr[-3000:]}")
    ref = load_file(out / "reference.safetensors")
    with safe_open(out / "reference.safetensors", "pt") as f:
        kinds = json.loads(f.metadata()["kinds"])
    return ref, kinds
