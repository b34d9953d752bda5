"""Benchmark `ckpt merge` (whole-model merges) against mergekit and sd-mecha on the same files.

Inputs: three synthetic bf16 Llama models of `--size-gb` each (default 4; about 2e9 parameters): a base and
two fine-tunes (base + N(0, 0.001) noise per element), as transformers writes them: a folder with config.json
(LlamaConfig, `architectures: [LlamaForCausalLM]`, untied head) and model.safetensors, or shards of at most
`--shard-gb` (default 5, transformers' `max_shard_size`) with model.safetensors.index.json. They are written
tensor by tensor in row chunks (the generator holds a few MB), with no ckpt code.

Recipes, each the YAML a mergekit user runs, with `dtype: float32` (every tool computes in fp32) and
`out_dtype: bfloat16` (a bf16 model in, a bf16 model out); `--methods` picks them (default linear, ties):
- linear: the three models, weight 1 each (normalized: their mean);
- ties:   base + the two fine-tunes, density 0.5 and weight 0.5 each (normalize: the mean of the deltas
          that agree with the elected sign);
- dare_ties, della: the ties recipe with that merge_method (their defaults otherwise: `rescale`, DELLA's
          epsilon 0.15; ckpt's `--seed` 0). Their masks are random (ckpt's counter-based hash, mergekit's torch
          generator), so their outputs are timed, not compared; with ties in the same run each prints its time as a
          ratio to ties' (issue 37: DARE and DELLA within 1.2x of TIES). sd-mecha has no driver for them.
Commands, each timed as a subprocess with its peak RSS (`os.wait4`, see benchlib.py), in this order:
- ckpt:             `ckpt merge RECIPE.yaml -o OUT -q` (fsyncs its output);
- mergekit-yaml:    `mergekit-yaml RECIPE.yaml OUT` (mergekit 0.1.5, default options), then `sync`;
- mergekit-pytorch: the same recipe over the raw model.safetensors files (its planner reads single files,
                    so it runs only when the models are one file each), then `sync`;
- sd-mecha:         a tiny driver (`--mecha`, run as a subprocess) over the model.safetensors files, whose keys
                    sd-mecha 1.1 loads under its "structural" model config (inferred from the keys when no
                    registered config matches): linear = `n_average(base, ft1, ft2)`, ties =
                    `add_difference(base, ties_sum(ft1 - base, ft2 - base, k=0.5, vote_sgn=True))`, merge
                    dtype fp32, output bf16, then `sync`. Its ties is comparable, not identical: it keeps every
                    magnitude equal to the threshold and drops both deltas where they cancel exactly (mergekit
                    and ckpt elect + there); reported, not checked. Single files only, as mergekit-pytorch;
- cp:               `cp -r` of ckpt's output folder then `sync`: the floor for writing those bytes durably here.
ckpt fsyncs its output, so every other tool's command ends with `sync` (only that command's own dirty pages:
every measurement starts after an untimed `sync`). Warm cache: the inputs are read once, untimed, first.

Target (per method): ckpt's peak RSS at most the import baseline (`python -c "import torch"`) + a few bands per
input (BAND_ELEMS = 8M elements x 4 bytes (fp32) x inputs x 4) + 300 MB. Printed as met / NOT met;
`--check-targets` exits 1 if one is not. Time is reported as a ratio to ckpt (and ckpt's to cp + sync).

Correctness (exit 1 on failure; `--no-verify` skips it): ckpt's output against mergekit-yaml's, streamed tensor
by tensor. Both compute in fp32 and round once to bf16; the only difference allowed is fp32 summation order, so
every element must be within 1 bf16 ulp (counted on the ordered bit patterns) or within ATOL = 2^-20 absolute
(near zero, where bf16 ulps are finer than fp32 rounding noise of the weights). For ties, mergekit's argsort
leaves the choice among magnitudes equal to the density threshold unspecified (ckpt keeps the first in row-major
order), and bf16 deltas tie often: an element may differ by more only where some fine-tune's |delta| equals its
tensor's threshold (the k-th largest |delta|, k = int(0.5 * numel)); any other difference fails.
mergekit-pytorch and sd-mecha outputs are compared with ckpt's the same way and reported, not checked.

The parent imports only the standard library (torch runs in subprocesses), as benchlib requires.
Internal entry points: `--generate ROOT PARAMS SHARD_BYTES`, `--mecha METHOD OUT BASE FT1 FT2`,
`--compare A B [BASE FT1 FT2 DENSITY]`.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

METHODS = ("linear", "ties", "dare_ties", "della")
DEFAULT_METHODS = ("linear", "ties")
RANDOMIZED = ("dare_ties", "della")  # masks drawn at random: timed against ties, outputs not compared
INPUTS = 3  # base + two fine-tunes, in both recipes
BANDS_PER_INPUT = 4  # "a few bands per input" of the RSS bound
NOISE = 0.001  # fine-tune delta std (weights ~ N(0, 0.02))
DENSITY = 0.5
CHUNK_ELEMS = 4 << 20  # generator: rows per write chunk <= this many elements
WIDTHS = (4096, 3072, 2048, 1536, 1024, 768, 512, 256, 128, 64)
MIN_LAYERS = 16
ATOL = 2.0 ** -20  # fp32 summation-order noise near zero, where bf16 ulps shrink below it


# ------------------------------------------------------------------------------------- the models

def llama_dims(params: int) -> dict:
    """A Llama of about `params` elements: the widest hidden size (from WIDTHS) that still gives 16 layers, head
    dim 64, 4 query heads per KV head, MLP 4x, vocab 32000 (4000 below width 1024), untied head."""
    def sizes(h):
        vocab = 32000 if h >= 1024 else 4000
        heads = max(1, h // 64)
        kv = max(1, heads // 4)
        layer = 2 * h * h + 2 * h * kv * 64 + 3 * h * 4 * h + 2 * h
        return vocab, heads, kv, layer, 2 * vocab * h + h
    h = next((w for w in WIDTHS if MIN_LAYERS * sizes(w)[3] + sizes(w)[4] <= params), WIDTHS[-1])
    vocab, heads, kv, layer, fixed = sizes(h)
    n = max(1, round((params - fixed) / layer))
    return {"hidden_size": h, "intermediate_size": 4 * h, "num_hidden_layers": n, "num_attention_heads": heads,
            "num_key_value_heads": kv, "head_dim": 64, "vocab_size": vocab}


def llama_tensors(d: dict) -> list[tuple[str, tuple[int, int] | tuple[int]]]:
    """(name, shape) of LlamaForCausalLM's state dict, in its order."""
    h, inter, kvd = d["hidden_size"], d["intermediate_size"], d["num_key_value_heads"] * d["head_dim"]
    qd = d["num_attention_heads"] * d["head_dim"]
    out = [("model.embed_tokens.weight", (d["vocab_size"], h))]
    for i in range(d["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (qd, h)), (p + "self_attn.k_proj.weight", (kvd, h)),
                (p + "self_attn.v_proj.weight", (kvd, h)), (p + "self_attn.o_proj.weight", (h, qd)),
                (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                (p + "mlp.down_proj.weight", (h, inter)), (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,))]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (d["vocab_size"], h))]
    return out


def llama_config(d: dict) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **d, "hidden_act": "silu",
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "bos_token_id": 1,
            "eos_token_id": 2, "initializer_range": 0.02, "torch_dtype": "bfloat16", "use_cache": True}


def _numel(shape) -> int:
    return math.prod(shape)


def shards(entries, max_bytes: int) -> list[list]:
    """transformers' split: tensors in order, a new shard when the next one would pass max_bytes."""
    out, cur, size = [], [], 0
    for name, shape in entries:
        b = _numel(shape) * 2
        if cur and size + b > max_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append((name, shape))
        size += b
    if cur:
        out.append(cur)
    return out


def generate(root: str, params: int, shard_bytes: int) -> dict:
    """Write base/, ft1/ and ft2/ under root, all three in one pass, tensor by tensor in row chunks."""
    import struct

    import torch

    d = llama_dims(params)
    entries = llama_tensors(d)
    parts = shards(entries, shard_bytes)
    names = ["base", "ft1", "ft2"]
    dirs = [Path(root) / n for n in names]
    single = len(parts) == 1
    files = ["model.safetensors"] if single else [f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
                                                   for i in range(len(parts))]
    g = torch.Generator().manual_seed(0)
    total = 0
    for p in dirs:
        p.mkdir(parents=True, exist_ok=True)
        (p / "config.json").write_text(json.dumps(llama_config(d), indent=2))
    weight_map = {}
    for fname, part in zip(files, parts):
        header, pos = {"__metadata__": {"format": "pt"}}, 0
        for name, shape in part:
            n = _numel(shape) * 2
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [pos, pos + n]}
            pos += n
            weight_map[name] = fname
        total += pos
        js = json.dumps(header, separators=(",", ":")).encode()
        js += b" " * (-(8 + len(js)) % 8)
        fs = [open(p / fname, "wb") for p in dirs]
        try:
            for f in fs:
                f.write(struct.pack("<Q", len(js)) + js)
            for name, shape in part:
                cols = shape[-1]
                rows = shape[0] if len(shape) == 2 else 1
                step = max(1, CHUNK_ELEMS // cols)
                for r in range(0, rows, step):
                    sh = (min(step, rows - r), cols)
                    if len(shape) == 1:  # RMSNorm scales: ones, perturbed
                        base = 1 + 0.02 * torch.randn(sh, generator=g)
                    else:
                        base = 0.02 * torch.randn(sh, generator=g)
                    outs = [base] + [base + NOISE * torch.randn(sh, generator=g) for _ in range(2)]
                    for f, t in zip(fs, outs):
                        f.write(t.to(torch.bfloat16).view(torch.int16).numpy().tobytes())
        finally:
            for f in fs:
                f.close()
    if not single:
        for p in dirs:
            (p / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    big = max(entries, key=lambda e: _numel(e[1]))
    return {"dims": d, "params": sum(_numel(s) for _, s in entries), "bytes": total, "tensors": len(entries),
            "shards": len(parts), "single_file": single, "largest": big[0], "largest_shape": list(big[1]),
            "dirs": [str(p) for p in dirs]}


def recipe(method: str, base: str, ft1: str, ft2: str) -> str:
    """The mergekit YAML (mergekit-yaml, mergekit-pytorch and ckpt read the same text)."""
    if method == "linear":
        body = (f"merge_method: linear\nmodels:\n  - model: {base}\n    parameters:\n      weight: 1.0\n"
                f"  - model: {ft1}\n    parameters:\n      weight: 1.0\n"
                f"  - model: {ft2}\n    parameters:\n      weight: 1.0\n")
    else:
        body = (f"merge_method: {method}\nbase_model: {base}\nmodels:\n"
                f"  - model: {ft1}\n    parameters:\n      density: {DENSITY}\n      weight: 0.5\n"
                f"  - model: {ft2}\n    parameters:\n      density: {DENSITY}\n      weight: 0.5\n"
                "parameters:\n  normalize: true\n")
    return body + "dtype: float32\nout_dtype: bfloat16\n"


# ----------------------------------------------------------------------------------- sd-mecha driver

def mecha(method: str, out: str, base: str, ft1: str, ft2: str) -> None:
    import functools

    import torch
    from tqdm import tqdm

    import sd_mecha
    from sd_mecha.extensions.builtin.merge_methods import linear as mecha_linear  # the merge method itself

    b, x, y = (sd_mecha.model(p) for p in (base, ft1, ft2))
    if method == "linear":
        r = sd_mecha.n_average(b, x, y)
    else:
        r = mecha_linear.add_difference(b, sd_mecha.ties_sum(sd_mecha.subtract(x, b), sd_mecha.subtract(y, b),
                                                             k=DENSITY, vote_sgn=True), alpha=1.0)
    sd_mecha.merge(r, output=out, merge_dtype=torch.float32, output_dtype=torch.bfloat16,
                   tqdm=functools.partial(tqdm, disable=True))


# ------------------------------------------------------------------------------------- comparison

def tensor_files(path: str) -> dict[str, str]:
    """name -> file of a safetensors file or model folder (index.json, else every *.safetensors)."""
    from safetensors import safe_open

    p = Path(path)
    if p.is_file():
        files = [p]
    else:
        idx = p / "model.safetensors.index.json"
        if idx.exists():
            return {k: str(p / v) for k, v in json.loads(idx.read_text())["weight_map"].items()}
        files = sorted(p.glob("*.safetensors"))
    out = {}
    for f in files:
        with safe_open(str(f), "pt") as st:
            out.update({k: str(f) for k in st.keys()})
    return out


def ordered_bf16(t):
    """bf16 bit patterns as integers ordered like the values (+0 and -0 both 0): differences count ulps."""
    import torch

    b = t.contiguous().view(torch.int16).int() & 0xFFFF
    return torch.where(b >= 0x8000, -(b & 0x7FFF), b)


def compare(a: str, b: str, inputs: list[str] | None = None, density: float = DENSITY) -> dict:
    """Tensor by tensor: elements apart by more than 1 bf16 ulp and more than ATOL; with `inputs` (base, ft1, ft2: a
    ties merge), every such element must sit at a magnitude threshold of some fine-tune's delta (see the module
    docstring). Elements where the two deltas cancel exactly (d1 + d2 == 0, where sd-mecha elects no sign) are
    counted apart among the others."""
    import torch
    from safetensors import safe_open

    fa, fb = tensor_files(a), tensor_files(b)
    if set(fa) != set(fb):
        return {"ok": False, "problem": f"keys differ: only in A {sorted(set(fa) - set(fb))[:3]}, "
                                        f"only in B {sorted(set(fb) - set(fa))[:3]}"}
    fin = [tensor_files(p) for p in inputs] if inputs else None
    elements = one_ulp = near_zero = over = at_threshold = unexplained = cancel = 0
    worst = 0
    problem = None

    def get(files, k):
        with safe_open(files[k], "pt") as st:
            return st.get_tensor(k)

    for k in sorted(fa):
        x, y = get(fa, k), get(fb, k)
        if x.dtype != y.dtype or x.shape != y.shape or x.dtype != torch.bfloat16:
            return {"ok": False,
                    "problem": f"{k}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)} (bf16 expected)"}
        u = (ordered_bf16(x) - ordered_bf16(y)).abs()
        close = (x.float() - y.float()).abs() <= ATOL
        del x, y
        elements += u.numel()
        one_ulp += int((u == 1).sum())
        near_zero += int(((u > 1) & close).sum())
        bad = (u > 1) & ~close
        nbad = int(bad.sum())
        if nbad:
            worst = max(worst, int(u[bad].max()))
            over += nbad
            if fin is None:
                problem = problem or f"{k}: {nbad} elements more than 1 ulp and {ATOL:.1e} apart"
                continue
            base = get(fin[0], k).float().reshape(-1)
            tied = torch.zeros(base.numel(), dtype=torch.bool)
            total = torch.zeros(base.numel())
            for files in fin[1:]:
                dlt = get(files, k).float().reshape(-1) - base
                total += dlt
                m = dlt.abs()
                del dlt
                kk = max(1, int(density * m.numel()))
                thr = torch.kthvalue(m, m.numel() - kk + 1).values  # the kk-th largest |delta|
                tied |= m == thr
                del m
            del base
            bad = bad.reshape(-1)
            at_threshold += int((bad & tied).sum())
            rest = bad & ~tied
            miss = int(rest.sum())
            if miss:
                unexplained += miss
                cancel += int((rest & (total == 0)).sum())
                problem = problem or f"{k}: {miss} elements differ by more than 1 ulp away from a density threshold"
            del total, tied, rest
        del u, bad, close
    return {"ok": problem is None, "elements": elements, "one_ulp": one_ulp, "near_zero": near_zero,
            "over_one_ulp": over, "at_threshold": at_threshold, "unexplained": unexplained, "cancel": cancel,
            "max_ulps": worst, "problem": problem}


# ---------------------------------------------------------------------------------------- parent

def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def synced(argv: list) -> list[str]:
    """argv, then `sync` (ckpt fsyncs its output; the other tools do not)."""
    return ["sh", "-c", '"$@" && sync', "sh", *map(str, argv)]


def tree_bytes(p: Path) -> int:
    return p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def remove(p: Path) -> None:
    if p.is_dir():
        shutil.rmtree(p)
    else:
        p.unlink(missing_ok=True)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--generate"]:
        print(json.dumps(generate(argv[1], int(argv[2]), int(argv[3]))))
        return 0
    if argv[:1] == ["--mecha"]:
        mecha(*argv[1:6])
        return 0
    if argv[:1] == ["--compare"]:
        rest = argv[3:]
        res = compare(argv[1], argv[2], rest[:3] or None, float(rest[3]) if len(rest) > 3 else DENSITY)
        print(json.dumps(res))
        return 0 if res["ok"] else 1
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=4.0, help="size of each model in bf16, GB (1e9 bytes); default 4")
    ap.add_argument("--shard-gb", type=float, default=5.0,
                    help="largest shard, GB (default 5, as transformers); one file per model when it fits")
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                    help=f"comma list of {', '.join(METHODS)} (default linear,ties)")
    bl.add_run_args(ap)  # --device of `ckpt merge`, --workdir (on the disk measured; default: the system temp dir,
    # /var/tmp if that is a tmpfs)
    ap.add_argument("--keep", action="store_true", help="keep the inputs and outputs (default: deleted at the end)")
    ap.add_argument("--no-mergekit", action="store_true", help="skip mergekit-yaml and mergekit-pytorch")
    ap.add_argument("--no-mecha", action="store_true", help="skip sd-mecha")
    ap.add_argument("--no-verify", action="store_true", help="skip the comparisons of outputs")
    ap.add_argument("--check-targets", action="store_true", help="exit 1 if a target is not met")
    ap.add_argument("--json", help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods or any(m not in METHODS for m in methods):
        ap.error(f"--methods: choose from {', '.join(METHODS)}")

    bindir = Path(sys.executable).parent
    mk_yaml, mk_pt = bindir / "mergekit-yaml", bindir / "mergekit-pytorch"
    skipped: list[str] = []
    use_mk = not args.no_mergekit and mk_yaml.exists()
    if not args.no_mergekit and not use_mk:
        skipped.append(f"mergekit: {mk_yaml} not found")
    use_mecha = not args.no_mecha
    if use_mecha:
        chk = bl.measure([sys.executable, "-c", "import sd_mecha"], check=False)
        if chk.returncode:
            use_mecha = False
            skipped.append("sd-mecha: not importable")

    params = int(args.size_gb * 1e9 / 2)
    baseline = bl.import_baseline("cpu")
    parent = Path(args.workdir) if args.workdir else Path(tempfile.gettempdir())
    if not args.workdir and bl.where(parent) in ("tmpfs", "ramfs"):
        parent = Path("/var/tmp")  # on disk: 3 inputs + outputs of --size-gb each do not belong in RAM
    parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-merge-models-", dir=parent))
    results: dict = {"machine": bl.machine_info(), "launcher_floor": bl.launcher_floor(),
                     "import_baseline_rss": baseline.peak_rss, "workdir": bl.where(parent), "methods": {}}
    ok = True
    try:
        log(f"generating 3 models of {args.size_gb} GB in {work} ...")
        m = bl.run_py(__file__, "--generate", work, params, int(args.shard_gb * 1e9))
        info = json.loads(m.stdout.strip().splitlines()[-1])
        results["info"] = info
        base, ft1, ft2 = (work / n for n in ("base", "ft1", "ft2"))
        single = info["single_file"]
        if not single:
            for tool in ("mergekit-pytorch", "sd-mecha"):
                skipped.append(f"{tool}: the models are {info['shards']} shards each; it reads single files")
        log("warm-up (untimed read of the inputs) ...")
        bl.measure(["sh", "-c", 'cat "$@" > /dev/null', "sh",
                    *[str(f) for d in (base, ft1, ft2) for f in sorted(d.glob("*.safetensors"))]])
        bound = int(baseline.peak_rss + bl.BAND_ELEMS * 4 * INPUTS * BANDS_PER_INPUT + bl.RSS_SLACK)
        for method in methods:
            yml = work / f"{method}.yaml"
            yml.write_text(recipe(method, str(base), str(ft1), str(ft2)))
            raw_yml = work / f"{method}-raw.yaml"
            raw_yml.write_text(recipe(method, *(str(d / "model.safetensors") for d in (base, ft1, ft2))))
            out = work / f"out-ckpt-{method}"
            runs: dict[str, bl.Measurement] = {}
            verify: dict[str, dict] = {}
            ties_inputs = [str(base), str(ft1), str(ft2), str(DENSITY)] if method == "ties" else []

            def check(name: str, other: Path) -> None:
                if args.no_verify or method in RANDOMIZED:
                    return
                log(f"  comparing ckpt with {name} ...")
                r = bl.run_py(__file__, "--compare", out, other, *ties_inputs, check=False)
                try:
                    verify[name] = json.loads(r.stdout.strip().splitlines()[-1])
                except (ValueError, IndexError):
                    verify[name] = {"ok": False, "problem": "compare failed: " + r.stderr.strip()[-500:]}

            log(f"{method}: ckpt merge ...")
            runs["ckpt"] = bl.measure(bl.ckpt_argv("merge", yml, "-o", out, "-q", "--device", args.device))
            out_bytes = tree_bytes(out)
            log(f"{method}: cp + sync of the output ...")
            cp_dst = work / "cp-copy"
            try:
                runs["cp + sync"] = bl.measure(["sh", "-c", 'cp -r -- "$1" "$2" && sync -- "$2"/*', "sh", out, cp_dst])
            finally:
                remove(cp_dst)
            if use_mk:
                mk_out = work / f"out-mergekit-{method}"
                log(f"{method}: mergekit-yaml ...")
                runs["mergekit-yaml"] = bl.measure(synced([mk_yaml, yml, mk_out]))
                check("mergekit-yaml", mk_out)
                if single and mk_pt.exists():
                    pt_out = work / f"out-mergekit-pytorch-{method}"
                    log(f"{method}: mergekit-pytorch ...")
                    runs["mergekit-pytorch"] = bl.measure(synced([mk_pt, raw_yml, pt_out]))
                    check("mergekit-pytorch", pt_out)
                    remove(pt_out)
                if not args.keep:
                    remove(mk_out)
            if use_mecha and single and method not in RANDOMIZED:
                me_out = work / f"out-sd-mecha-{method}.safetensors"
                log(f"{method}: sd-mecha ...")
                runs["sd-mecha"] = bl.measure(synced([sys.executable, __file__, "--mecha", method, me_out,
                                                      *(d / "model.safetensors" for d in (base, ft1, ft2))]))
                check("sd-mecha", me_out)
                remove(me_out)
            if not args.keep:
                remove(out)
            ck = runs["ckpt"]
            rss_ok = ck.peak_rss <= bound
            checked = verify.get("mergekit-yaml")
            if checked is not None and not checked["ok"]:
                ok = False
            if not rss_ok and args.check_targets:
                ok = False
            results["methods"][method] = {
                "out_bytes": out_bytes, "rss_bound": bound, "rss_ok": rss_ok, "verify": verify,
                "vs_cp": ck.seconds / runs["cp + sync"].seconds,
                "runs": {k: {"seconds": v.seconds, "peak_rss": v.peak_rss, "vs_ckpt": v.seconds / ck.seconds}
                         for k, v in runs.items()}}
        ties = results["methods"].get("ties")
        for method, r in results["methods"].items():
            if ties is not None and method != "ties":
                r["vs_ties"] = r["runs"]["ckpt"]["seconds"] / ties["runs"]["ckpt"]["seconds"]
        results["skipped"] = skipped
        print_report(results, baseline, parent, bound)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
        return 0 if ok else 1
    finally:
        if args.keep:
            log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def print_report(results: dict, baseline, parent: Path, bound: int) -> None:
    info = results["info"]
    d = info["dims"]
    print("\n".join(bl.machine_lines()))
    print(f"files in {parent} ({bl.where(parent)}); launcher RSS floor {bl.fmt_mb(results['launcher_floor'])} MB")
    print(f"models: 3 x {bl.fmt_gb(info['bytes'])} GB bf16 Llama ({info['params'] / 1e9:.2f}e9 params: hidden "
          f"{d['hidden_size']}, {d['num_hidden_layers']} layers, vocab {d['vocab_size']}, {info['tensors']} tensors, "
          f"largest {info['largest']} {info['largest_shape']}), {info['shards']} shard(s) each")
    print(f"tolerance: ckpt vs mergekit-yaml, every element within 1 bf16 ulp or {ATOL:.1e} (fp32 summation order, "
          "then one rounding to bf16); ties: also any element where a fine-tune's |delta| equals its density "
          "threshold (mergekit's argsort picks among equal magnitudes at random)")
    print(f"RSS target: import baseline {bl.fmt_mb(baseline.peak_rss)} + {BANDS_PER_INPUT} bands x {INPUTS} inputs x "
          f"{bl.BAND_ELEMS >> 20}M x 4 B {bl.fmt_mb(bl.BAND_ELEMS * 4 * INPUTS * BANDS_PER_INPUT)} + 300 = "
          f"{bl.fmt_mb(bound)} MB")
    for method, r in results["methods"].items():
        print(f"\n{method} (dtype float32, out_dtype bfloat16; output {bl.fmt_gb(r['out_bytes'])} GB):")
        rows = [[name, f"{v['seconds']:.1f}", f"{v['vs_ckpt']:.2f}x", bl.fmt_mb(v["peak_rss"]),
                 bl.gbps(3 * info["bytes"], v["seconds"])] for name, v in r["runs"].items()]
        print(bl.markdown_table(["command", "seconds", "vs ckpt", "peak RSS MB", "input GB/s"], rows))
        ck = r["runs"]["ckpt"]
        print(f"ckpt: {ck['seconds']:.1f} s = {r['vs_cp']:.2f}x cp + sync of its output; peak RSS "
              f"{bl.fmt_mb(ck['peak_rss'])} MB <= {bl.fmt_mb(r['rss_bound'])} MB: "
              f"{'met' if r['rss_ok'] else 'NOT met'}")
        if "vs_ties" in r:
            print(f"ckpt {method} / ckpt ties (same run): {r['vs_ties']:.2f}x")
        for name, v in r["verify"].items():
            if v.get("elements") is None:
                print(f"ckpt vs {name}: FAILED ({v.get('problem')})")
                continue
            checked = name == "mergekit-yaml"
            far = (f"{v['over_one_ulp']} further apart ({v['at_threshold']} at a density threshold, "
                   f"{v['unexplained']} elsewhere" + (f", {v['cancel']} of them where the deltas cancel"
                                                       if v["cancel"] else "") + f"; max {v['max_ulps']} ulps)")
            verdict = ("ok" if v["ok"] else "MISMATCH") if checked else ("same" if v["ok"] else "differs")
            print(f"ckpt vs {name} ({'checked' if checked else 'reported'}): {verdict}: {v['elements']} elements, "
                  f"{v['one_ulp']} 1 ulp apart, {v['near_zero']} more but within {ATOL:.1e}, {far}")
    for s in results.get("skipped", []):
        print(f"skipped: {s}")


if __name__ == "__main__":
    sys.exit(main())
