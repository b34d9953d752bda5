"""README.md and docs/*.md stay true to the code they describe.

- Every file path (`ckpt/...`, `tests/...`, `scripts/...`, `docs/...`, `.ci/...`), dotted module name
  (`ckpt.io.plan`) and relative link they name exists; a link's `#anchor` is a heading of its page.
- The tables list what the registries hold: the formats table every quantized format (`ckpt.quant.formats`), the
  families table every family (`ckpt.families`), the merge methods table every method (`ckpt.merge.methods`),
  and docs/targets.md every `--to` name (`ckpt.targets`). Its table of which command takes which target is
  checked against the commands themselves: a dry run with that target is accepted where it says "yes" and
  refused naming `--to` where it says "no".
- Every example runs as written: each `ckpt ...` line of a ```bash block runs through the real CLI, with
  `--dry-run` added where the command has it, in one folder holding tiny inputs with the names the examples use
  (built once for the module; quantized and GGUF inputs are written by ckpt itself from the tiny models, hub ids
  are answered by a huggingface_hub cache made here, offline). A line whose comment ends in `(not run: why)` is
  only parsed by click; those are counted, and more than a tenth of the examples skipped fails the test. Where
  a comment names the output (`# -> flux1-dev-Q4_K_M.gguf`), the dry run must say it would write that.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import click
import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from families_util import original_from_pairs, state_dict

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
NOT_RUN = re.compile(r"#.*\(not run: ([^)]+)\)\s*$")
MAX_SKIPPED = 0.10  # of the examples
ARROW = re.compile(r"#.*?->\s*(\S+)")  # the output an example's comment names (`# -> x-fp16.safetensors`)
# Options that make a command a non-writing mode of its own, where --dry-run is not added.
OWN_MODES = {"--print-config", "--plan-only", "--collect"}
# Dotted names in the docs that are no module: the GGUF metadata keys ckpt writes.
NOT_MODULES = {"ckpt.version", "ckpt.operation"}
HUB_REV = "a" * 40


def _text(doc: Path) -> str:
    return doc.read_text(encoding="utf-8")


def _rel(doc: Path) -> str:
    return str(doc.relative_to(REPO))


# ------------------------------------------------------------------------------------------------ (a) paths

PATH_RE = re.compile(r"(?<![\w./~$-])((?:ckpt|tests|scripts|docs|\.ci)/[\w./*<>-]*)")
MODULE_RE = re.compile(r"(?<![\w./-])(ckpt(?:\.[A-Za-z_]\w*)+)")
LINK_RE = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but `-` and `_` dropped, spaces as `-`."""
    s = heading.strip().lower().replace("`", "")
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def _anchors(doc: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", _text(doc), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", text, re.M)}


def test_every_path_module_and_link_the_docs_name_exists():
    import importlib

    missing = []
    for doc in DOCS:
        text = _text(doc)
        for raw in sorted(set(PATH_RE.findall(text))):
            path = raw.rstrip(".,:;")
            if "<" in path:  # a placeholder: ckpt/families/<family>.py
                continue
            if not (list(REPO.glob(path)) if "*" in path else (REPO / path).exists()):
                missing.append(f"{_rel(doc)}: path {path}")
        for name in sorted(set(MODULE_RE.findall(text)) - NOT_MODULES):
            parts = name.split(".")
            for i in range(len(parts), 0, -1):
                try:
                    obj = importlib.import_module(".".join(parts[:i]))
                    break
                except ImportError:
                    continue
            try:
                for attr in parts[i:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                missing.append(f"{_rel(doc)}: module name {name}")
        for link in sorted(set(LINK_RE.findall(text))):
            if re.match(r"[a-z]+://", link):
                continue
            target, _, anchor = link.partition("#")
            page = (doc.parent / target).resolve() if target else doc
            if not page.exists():
                missing.append(f"{_rel(doc)}: link {link}")
            elif anchor and page.suffix == ".md" and anchor not in _anchors(page):
                missing.append(f"{_rel(doc)}: link {link}: no heading #{anchor} in {page.name}")
    assert not missing, "\n".join(missing)


# ------------------------------------------------------------------------------------------------ (b) tables


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _tables(doc: Path, first_header: str) -> list[tuple[list[str], list[list[str]]]]:
    """(header, rows) of every table in `doc` whose first header cell is `first_header`, cells stripped."""
    lines, found = _text(doc).splitlines(), []
    for i, line in enumerate(lines):
        if line.startswith("|") and _cells(line)[0] == first_header and lines[i + 1].startswith("|---"):
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append(_cells(row))
            found.append((_cells(line), rows))
    assert found, f"{_rel(doc)} has no table headed {first_header!r}"
    return found


def _table(doc: Path, first_header: str) -> list[list[str]]:
    """The rows of the first table in `doc` whose first header cell is `first_header`."""
    return _tables(doc, first_header)[0][1]


def _names(cell: str) -> set[str]:
    return set(re.findall(r"`([^`]+)`", cell))


def test_formats_table_lists_every_registered_quantized_format():
    from ckpt.quant.formats import formats

    firsts = [re.sub(r"[`*]", "", row[0]).lower() for row in _table(REPO / "docs" / "formats.md", "Format")]
    missing = [f.name for f in formats() if not any(f.label.lower() in c or f.name.lower() in c for c in firsts)]
    assert not missing, f"docs/formats.md: no row for the registered formats {missing}"


def test_families_table_is_the_family_registry():
    from ckpt import families

    registered = {fid for fam in families.all_families() for fid in fam.all_ids}
    documented = set().union(*(_names(row[0]) for row in _table(REPO / "docs" / "families.md", "family_id")))
    assert documented == registered, (f"docs/families.md lacks {sorted(registered - documented)}, "
                                      f"names unregistered {sorted(documented - registered)}")


def test_merge_methods_table_is_the_method_registry():
    from ckpt.merge.methods import methods

    documented = set().union(*(_names(row[0]) for row in _table(REPO / "docs" / "merging.md", "method")))
    assert documented == set(methods()), (f"docs/merging.md lacks {sorted(set(methods()) - documented)}, "
                                          f"names unregistered {sorted(documented - set(methods()))}")


def test_targets_page_lists_every_to_name_and_no_other():
    from ckpt import targets

    text = _text(REPO / "docs" / "targets.md")
    named = _names(text)
    missing = [n for n in targets.names() if n not in named]
    assert not missing, f"docs/targets.md does not name the --to targets {missing}"
    placeholders = {"gguf-TYPE", *targets.prefixes()}
    prefixed = {n for n in named if n.startswith(targets.prefixes()) and n not in placeholders and "*" not in n}
    assert prefixed <= set(targets.names()), f"docs/targets.md names {sorted(prefixed - set(targets.names()))}"
    rows = _table(REPO / "docs" / "targets.md", "`--to`")
    # a kind that owns a name prefix (gguf-, ct-) may list its names in the table or stand for them with one row
    listed = {n for row in rows for n in _names(row[0]) if not n.startswith(targets.prefixes())}
    unprefixed = {n for n in targets.names() if not n.startswith(targets.prefixes())}
    assert listed == unprefixed, f"the targets table lists {sorted(listed)}, the registry {sorted(unprefixed)}"


# ------------------------------------------------------------------------------------------------ (c) examples


def _examples() -> list[tuple[str, str]]:
    """(`doc:line`, line) of every `ckpt ...` line in the ```bash blocks of the docs, in order."""
    out = []
    for doc in DOCS:
        text = _text(doc)
        for block in re.finditer(r"```bash\n(.*?)```", text, re.S):
            first = text[:block.start(1)].count("\n") + 1
            for k, line in enumerate(block[1].splitlines()):
                if line.startswith("ckpt "):
                    out.append((f"{_rel(doc)}:{first + k}", line))
    return out


EXAMPLES = _examples()


def _split(line: str) -> tuple[list[str], str | None]:
    """The command's arguments (after `ckpt`) and the file its stdout is redirected to, if any; a pipe's other
    side is dropped."""
    tokens = shlex.split(line, comments=True)[1:]
    if "|" in tokens:
        tokens = tokens[:tokens.index("|")]
    if ">" in tokens:
        i = tokens.index(">")
        return tokens[:i], tokens[i + 1]
    return tokens, None


def _command(args: list[str]) -> tuple[click.Command, list[str], list[str]]:
    """The click command the arguments name, its path of names, and the arguments left for it."""
    from ckpt.cli import cli

    cmd, path = cli, []
    while isinstance(cmd, click.Group):
        sub = cmd.get_command(click.Context(cmd), args[0])
        assert sub is not None, f"no command {' '.join(path + args[:1])}"
        path.append(args[0])
        cmd, args = sub, args[1:]
    return cmd, path, args


def _has_dry_run(cmd: click.Command) -> bool:
    return any("--dry-run" in p.opts for p in cmd.params)


def _argv(line: str) -> tuple[list[str], str | None]:
    args, redirect = _split(line)
    cmd, _, _ = _command(args)
    if _has_dry_run(cmd) and "--dry-run" not in args and not OWN_MODES & set(args):
        args = [*args, "--dry-run"]
    return args, redirect


def _run(argv: list[str]) -> tuple[int, str, str]:
    import contextlib
    import io

    from ckpt.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(argv))
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return code, out.getvalue(), err.getvalue()


def _ckpt(*argv) -> None:
    """Build an input with ckpt itself (inputs, not oracles: these tests check that examples run)."""
    code, _, err = _run([str(a) for a in argv] + ["-q"])
    assert code == 0, (argv, err)


# The tiny inputs, named as the examples name them ----------------------------------------------------------


def _flux(root: Path) -> dict:
    from diffusers import FluxTransformer2DModel

    from ckpt.families import get

    torch.manual_seed(0)
    model = FluxTransformer2DModel(in_channels=4, num_layers=1, num_single_layers=2, attention_head_dim=128,
                                   num_attention_heads=1, joint_attention_dim=16, pooled_projection_dim=16,
                                   guidance_embeds=True, axes_dims_rope=(16, 56, 56))  # Flux's head size
    model.save_pretrained(root / "flux1-dev-diffusers")
    original = {k: v.to(torch.bfloat16) for k, v in original_from_pairs(get("flux1"), state_dict(model)).items()}
    save_file(original, root / "flux1-dev.safetensors")
    shutil.copy(root / "flux1-dev.safetensors", root / "model.safetensors")
    g = torch.Generator().manual_seed(1)
    tuned = {k: (v.float() + 0.01 * torch.randn(v.shape, generator=g)).to(v.dtype) for k, v in original.items()}
    save_file(tuned, root / "flux1-dev-tuned.safetensors")
    save_file({k: v.to(torch.float8_e4m3fn) if v.ndim == 2 else v for k, v in original.items()},
              root / "flux1-dev-fp8.safetensors")
    torch.save(original, root / "old.ckpt")
    for name, shape in [("a", (32, 32)), ("b", (32, 32)), ("c", (32, 32))]:
        save_file({"x.weight": torch.randn(*shape, generator=g), "x.bias": torch.randn(shape[0], generator=g)},
                  root / f"{name}.safetensors")

    def kohya(path, modules: dict, rank: int, alpha: float):
        sd = {}
        for m, (out, inp) in modules.items():
            sd[f"{m}.lora_down.weight"] = torch.randn(rank, inp, generator=g) * 0.05
            sd[f"{m}.lora_up.weight"] = torch.randn(out, rank, generator=g) * 0.05
            sd[f"{m}.alpha"] = torch.tensor(alpha)
        save_file(sd, path)

    def shapes(*modules):  # kohya module name -> the shape of the weight it lands on
        return {"lora_unet_" + m.replace(".", "_"): tuple(original[m + ".weight"].shape) for m in modules}

    kohya(root / "my_lora.safetensors", shapes("double_blocks.0.img_attn.proj", "double_blocks.0.img_attn.qkv",
                                               "double_blocks.0.img_mlp.2"), rank=64, alpha=32.0)
    kohya(root / "style.safetensors", shapes("double_blocks.0.txt_attn.proj", "single_blocks.1.linear1"),
          rank=16, alpha=16.0)
    (m, (out, inp)), = shapes("double_blocks.0.img_mlp.0").items()
    loha = {"hada_w1_a": (out, 4), "hada_w1_b": (4, inp), "hada_w2_a": (out, 4), "hada_w2_b": (4, inp)}
    save_file({f"{m}.{k}": torch.randn(*shape, generator=g) * 0.1 for k, shape in loha.items()}
              | {f"{m}.alpha": torch.tensor(4.0)}, root / "detail-loha.safetensors")

    # written by ckpt from the tiny files above
    _ckpt("convert", root / "flux1-dev.safetensors", "--to", "fp8_e4m3fn", "--scaled",
          "-o", root / "flux1-dev-fp8-scaled.safetensors")
    _ckpt("convert", root / "flux1-dev.safetensors", "--to", "nvfp4", "-o", root / "flux1-dev-nvfp4.safetensors")
    _ckpt("convert", root / "flux1-dev.safetensors", "--to", "gguf-q8_0", "-o", root / "flux1-dev-Q8_0.gguf")
    _ckpt("lora", "convert", root / "my_lora.safetensors", "--format", "diffusers",
          "-o", root / "diffusers_flux_lora.safetensors")

    from optimum.quanto import freeze, qint8, quantization_map, quantize

    quantize(model, weights=qint8)
    freeze(model)
    q = root / "flux1-dev-qint8"
    q.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, q / "diffusion_pytorch_model.safetensors")
    (q / "quanto_qmap.json").write_text(json.dumps(quantization_map(model)))
    shutil.copy(root / "flux1-dev-diffusers" / "config.json", q / "config.json")

    from helpers.bnb_ref import bnb_4bit

    forge = {}
    for name in ("double_blocks.0.img_attn.qkv.weight", "single_blocks.0.linear1.weight"):
        forge |= bnb_4bit(original[name], "nf4", 64, True, "model.diffusion_model." + name)[0]
    forge |= {"model.diffusion_model." + k: v for k, v in original.items() if k.startswith("final_layer.")}
    save_file(forge, root / "flux1-dev-bnb-nf4-v2.safetensors")

    for d, files in {"models/checkpoints": ["flux1-dev.safetensors"], "models/loras": ["style.safetensors"]}.items():
        (root / d).mkdir(parents=True)
        for f in files:
            shutil.copy(root / f, root / d / f)
    return original


def _wan(root: Path, hub: Path) -> None:
    from diffusers import WanTransformer3DModel

    from families_util import wan_original_layout

    torch.manual_seed(0)
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=1, attention_head_dim=128,  # Wan's head
                                  in_channels=4, out_channels=4, text_dim=16, freq_dim=8, ffn_dim=32, num_layers=1)
    save_file({k: v.to(torch.bfloat16) for k, v in wan_original_layout(model).items()},
              root / "wan2.1_t2v_14B_bf16.safetensors")
    model.save_config(_snapshot(hub, "Wan-AI/Wan2.1-T2V-14B-Diffusers") / "transformer")


def _sd15(root: Path, hub: Path) -> None:
    import diffusers
    import transformers

    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16, attention_head_dim=8)
    vae = diffusers.AutoencoderKL(block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2,
                                  up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, layers_per_block=1)
    clip = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, vocab_size=64,
        max_position_embeddings=8, bos_token_id=0, eos_token_id=1, pad_token_id=1))
    pipe = root / "my-sd15-pipeline"
    index = {"_class_name": "StableDiffusionPipeline", "_diffusers_version": "0.42.0",
             "scheduler": ["diffusers", "EulerDiscreteScheduler"], "tokenizer": ["transformers", "CLIPTokenizer"]}
    for name, m in {"unet": unet, "vae": vae, "text_encoder": clip}.items():
        m.save_pretrained(pipe / name)
        index[name] = ["diffusers" if name != "text_encoder" else "transformers", type(m).__name__]
    diffusers.EulerDiscreteScheduler().save_pretrained(pipe / "scheduler")
    (pipe / "tokenizer").mkdir()
    (pipe / "tokenizer" / "vocab.json").write_text('{"a": 0}')
    (pipe / "model_index.json").write_text(json.dumps(index))
    shutil.copytree(pipe, _snapshot(hub, "stable-diffusion-v1-5/stable-diffusion-v1-5"), dirs_exist_ok=True)
    _ckpt("convert", pipe, "--layout", "original", "-o", root / "sd15.safetensors")
    g = torch.Generator().manual_seed(2)
    m = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"
    w = unet.state_dict()["down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight"]
    save_file({f"{m}.lora_down.weight": torch.randn(4, w.shape[1], generator=g),
               f"{m}.lora_up.weight": torch.randn(w.shape[0], 4, generator=g), f"{m}.alpha": torch.tensor(4.0)},
              root / "sd15-kohya-lora.safetensors")


def _llms(root: Path) -> None:
    from helpers.hf_llm import model_folder

    base = model_folder(root / "Mistral-7B-v0.3", "mistral")  # tiny, with a SentencePiece tokenizer
    sd = load_file(base / "model.safetensors")
    for i, name in enumerate(["mistral-math", "mistral-code"]):
        g = torch.Generator().manual_seed(10 + i)
        (root / name).mkdir()
        save_file({k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in sd.items()},
                  root / name / "model.safetensors", metadata={"format": "pt"})
        shutil.copy(base / "config.json", root / name / "config.json")
    _ckpt("convert", base, "--to", "gguf-f16", "-o", root / "Mistral-7B-v0.3-F16.gguf")
    _ckpt("convert", base, "--to", "gguf-q8_0", "-o", root / "Mistral-7B-v0.3-Q8_0.gguf")
    import gguf
    from helpers import imatrix_files

    shapes = {t.name: (1, int(t.shape[0])) for t in gguf.GGUFReader(str(root / "Mistral-7B-v0.3-F16.gguf")).tensors
              if len(t.shape) >= 2}
    imatrix_files.write_gguf(root / "imatrix.gguf", imatrix_files.random_stats(shapes))  # what llama-imatrix writes

    cfg = json.loads((base / "config.json").read_text())
    head = cfg["hidden_size"] // cfg["num_attention_heads"]
    outs = {"q_proj": cfg["hidden_size"], "v_proj": cfg["num_key_value_heads"] * head}
    g = torch.Generator().manual_seed(3)
    adapter = {}
    for layer in range(cfg["num_hidden_layers"]):
        for proj, out in outs.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            adapter[f"{key}.lora_A.weight"] = torch.randn(8, cfg["hidden_size"], generator=g) * 0.05
            adapter[f"{key}.lora_B.weight"] = torch.randn(out, 8, generator=g) * 0.05
    peft = root / "my-peft-adapter"
    peft.mkdir()
    save_file(adapter, peft / "adapter_model.safetensors")
    (peft / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8, "lora_alpha": 16, "target_modules": list(outs),
        "base_model_name_or_path": "Mistral-7B-v0.3"}))

    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
                     ).to(torch.bfloat16).save_pretrained(root / "llama-fp")
    q = AutoModelForCausalLM.from_pretrained(root / "llama-fp", device_map="cpu", dtype=torch.bfloat16,
                                             quantization_config=BitsAndBytesConfig(load_in_4bit=True,
                                                                                    bnb_4bit_quant_type="nf4"))
    q.save_pretrained(root / "llama-bnb-4bit")
    shutil.rmtree(root / "llama-fp")


def _quanto(root: Path, hub: Path) -> None:
    from optimum.quanto import freeze, qint2, qint4, qint8, quantization_map, quantize

    def quantized(layer, qtype):
        m = torch.nn.Sequential(layer)
        quantize(m, weights=qtype)
        freeze(m)
        return m

    torch.manual_seed(0)
    m = quantized(torch.nn.Linear(32, 16), qint8)
    ck = root / "checkpoint-4000"
    ck.mkdir()
    save_file(m.state_dict(), ck / "diffusion_pytorch_model.safetensors")
    (ck / "quanto_qmap.json").write_text(json.dumps(quantization_map(m)))
    (ck / "config.json").write_text("{}")
    shutil.copytree(ck, root / "output" / "checkpoint-4000")

    plain = torch.nn.Linear(256, 32, bias=False)
    save_file({"0.weight": plain.weight.detach().clone()}, root / "plain.safetensors")
    m = quantized(plain, qint4)  # grouped, no bias: the file alone does not say the shape
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, root / "q4")
    m = quantized(torch.nn.Linear(20, 2, bias=False), qint2)  # two rows: 4 or 2 bits?
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, root / "q2.safetensors")

    snap = _snapshot(hub, "owner/name")
    (snap / "transformer").mkdir()
    save_file({"0.weight": torch.zeros(32, 256)}, snap / "transformer" / "diffusion_pytorch_model.safetensors")
    (snap / "unet").mkdir()
    save_file({"conv.weight": torch.randn(4, 4), "conv.bias": torch.randn(4)},
              snap / "unet" / "diffusion_pytorch_model.safetensors")
    (snap / "unet" / "config.json").write_text(json.dumps({"_class_name": "UNet2DConditionModel"}))


def _litgpt(root: Path) -> None:
    cfg = dict(name="tiny", n_embd=8, n_head=2, n_query_groups=1, head_size=4, n_layer=1)
    base = root / "checkpoints" / "meta-llama" / "Llama-3.2-1B"
    base.mkdir(parents=True)
    g = torch.Generator().manual_seed(4)
    torch.save({"transformer.h.0.attn.qkv.weight": torch.randn(16, 8, generator=g),
                "transformer.h.0.attn.proj.weight": torch.randn(8, 8, generator=g)}, base / "lit_model.pth")
    (base / "model_config.yaml").write_text(yaml.safe_dump(cfg))
    shutil.copy(base / "lit_model.pth", root / "lit_model.pth")
    hp = dict(checkpoint_dir="checkpoints/meta-llama/Llama-3.2-1B", precision="32-true", lora_r=2, lora_alpha=4,
              lora_query=True, lora_key=False, lora_value=True, lora_projection=False, lora_mlp=False, lora_head=False)
    for step in ("final", "step-000800"):
        ft = root / "out" / "finetune" / "lora" / step
        ft.mkdir(parents=True)
        torch.save({"model": {"transformer.h.0.attn.qkv.lora_A": torch.randn(4, 8, generator=g),
                              "transformer.h.0.attn.qkv.lora_B": torch.randn(12, 2, generator=g)}},
                   ft / "lit_model.pth.lora")
        (ft / "hyperparameters.yaml").write_text(yaml.safe_dump(hp))
        (ft / "model_config.yaml").write_text(yaml.safe_dump(cfg))


def _snapshot(hub: Path, repo: str) -> Path:
    """A repository in huggingface_hub's cache layout (refs/main -> snapshots/REV)."""
    base = hub / ("models--" + repo.replace("/", "--"))
    (base / "refs").mkdir(parents=True, exist_ok=True)
    (base / "refs" / "main").write_text(HUB_REV)
    snap = base / "snapshots" / HUB_REV
    snap.mkdir(parents=True, exist_ok=True)
    return snap


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """The folder the examples run in, holding every input they name; the working directory while they run.
    Lines that redirect their output (`--print-config > ties.yaml`) are run once here, in order, so that each
    example can run alone."""
    root = tmp_path_factory.mktemp("docs")
    hub = root.parent / (root.name + "-hub")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_CACHE", str(hub))
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there: any request would fail
        mp.chdir(root)
        _flux(root)
        _wan(root, hub)
        _sd15(root, hub)
        _llms(root)
        _quanto(root, hub)
        _litgpt(root)
        for where, line in EXAMPLES:
            if NOT_RUN.search(line) is None and _split(line)[1] is not None:
                argv, redirect = _argv(line)
                code, out, err = _run(argv)
                assert code == 0, (where, line, err)
                (root / redirect).write_text(out)
        yield root


@pytest.mark.parametrize("where,line", EXAMPLES, ids=[w for w, _ in EXAMPLES])
def test_example_runs_as_written(inputs, where, line):
    args, redirect = _split(line)
    cmd, path, rest = _command(args)
    cmd.make_context(" ".join(["ckpt", *path]), list(rest))  # click parses it: options, choices, arguments
    why = NOT_RUN.search(line)
    if why:
        pytest.skip(f"not run: {why[1]}")
    code, out, err = _run(_argv(line)[0])
    assert code == 0, f"{where}: {line}\n{err}"
    said, wrote = ARROW.search(line), re.search(r"would write (\S+)", out + err)
    if said and wrote and "*" not in said[1] and "0000N" not in said[1]:
        named = said[1].rstrip("/)")
        if said[1].endswith("/") or named.endswith((".safetensors", ".gguf", ".pth", ".bin")):
            assert Path(wrote[1]).name in Path(named).parts, \
                f"{where}: the comment says {named}, ckpt writes {wrote[1]}"


def test_few_examples_are_skipped():
    skipped = [(w, NOT_RUN.search(line)[1]) for w, line in EXAMPLES if NOT_RUN.search(line)]
    assert len(EXAMPLES) >= 80
    assert len(skipped) <= MAX_SKIPPED * len(EXAMPLES), skipped


# The table of which command takes which target, against the commands themselves -------------------------

TARGET_RUNS = {  # a command line each command accepts with the targets it takes
    "convert": ["convert", "flux1-dev.safetensors"],
    "merge-lora": ["merge-lora", "flux1-dev.safetensors", "my_lora.safetensors"],
    "merge": ["merge", "flux1-dev.safetensors", "flux1-dev-tuned.safetensors"],
    "dequant": ["dequant", "flux1-dev-fp8-scaled.safetensors"],
    "batch convert": ["batch", "convert", "models", "-o", "models-out"],
    "batch merge-lora": ["batch", "merge-lora", "models/checkpoints", "--lora", "models/loras/style.safetensors",
                         "-o", "models-merged"],
    "batch dequant": ["batch", "dequant", "output", "-o", "output-out"],
}


# The targets that write a Hugging Face LLM only (compressed-tensors, MLX) are tried on the tiny Mistral instead.
LLM_TARGET_RUNS = {
    "convert": ["convert", "Mistral-7B-v0.3"],
    "merge-lora": ["merge-lora", "Mistral-7B-v0.3", "my-peft-adapter"],
    "merge": ["merge", "Mistral-7B-v0.3", "mistral-math"],
    "dequant": ["dequant", "llama-bnb-4bit"],
}
LLM_ONLY = ("ct-", "mlx-")


def test_targets_table_says_which_command_takes_which_target(inputs):
    (header, rows), = [t for t in _tables(REPO / "docs" / "targets.md", "`--to`") if "convert" in t[0]]
    assert set(header[1:]) == set(TARGET_RUNS), header
    wrong = []
    for row in rows:
        first = "gguf-q8_0" if "gguf-TYPE" in row[0] else re.findall(r"`([^`]+)`", row[0])[0]
        for command, cell in zip(header[1:], row[1:]):
            assert cell in ("yes", "no"), (row[0], command, cell)
            runs = LLM_TARGET_RUNS if first.startswith(LLM_ONLY) and command in LLM_TARGET_RUNS else TARGET_RUNS
            code, _, err = _run([*runs[command], "--to", first, "--dry-run"])
            if cell == "yes" and code != 0:
                wrong.append(f"{command} --to {first}: the table says yes, the command says: {err.strip()}")
            elif cell == "no" and not (code == 2 and "--to" in err):
                wrong.append(f"{command} --to {first}: the table says no, the command "
                             + ("accepts it" if code == 0 else f"says: {err.strip()}"))
    assert not wrong, "docs/targets.md:\n" + "\n".join(wrong)


def test_llm_architectures_table_is_the_architecture_registry():
    """docs/gguf.md's table of llama.cpp LLM architectures: one row per registered module, its HF classes and whether
    ckpt reads its GGUFs back, as the modules declare them."""
    from ckpt.families.llm.architectures import ALL

    rows = {next(iter(_names(r[0]))): r for r in _table(REPO / "docs" / "gguf.md", "architecture")}
    assert set(rows) == set(ALL), (f"docs/gguf.md lacks {sorted(set(ALL) - set(rows))}, "
                                   f"names unregistered {sorted(set(rows) - set(ALL))}")
    for name, arch in ALL.items():
        assert _names(rows[name][1]) == set(arch.hf_classes), name
        assert rows[name][2].startswith("yes" if arch.readable else "no"), name
