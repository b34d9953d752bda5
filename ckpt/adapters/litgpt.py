"""LitGPT LoRA checkpoints: `lit_model.pth.lora` and the YAML files beside it.

`litgpt finetune lora` saves only the LoRA tensors, `{"model": {"<module>.lora_A": ..., "<module>.lora_B":
...}}`, in a finetune folder with `hyperparameters.yaml` (lora_r, lora_alpha, which projections carry LoRA,
`checkpoint_dir`: the base model folder) and `model_config.yaml` (n_head, n_query_groups, head_size).
`litgpt merge_lora` instantiates the whole model to merge; here the merge is planned from these files and
the base's state dict alone, so nothing is ever on the meta device.

What the files mean (litgpt 0.5, `litgpt/lora.py`):
- Every LoRA layer is `W += (lora_B @ lora_A) * lora_alpha / lora_r`.
- The fused attention weight `attn.qkv.weight` stores Q (n_head * head_size rows), then K, then V
  (n_query_groups * head_size rows each). Its LoRA (LoRAQKVLinear) stacks one rank-r factor pair per
  enabled projection (lora_query/key/value): `lora_A` holds r rows per enabled projection, `lora_B` the
  enabled projections' rows; the delta of projection i is `lora_B_i @ lora_A_i`, and a disabled
  projection gets none. Each piece is merged here as a plain LoRA on its own rows of `qkv.weight`.
- Older LitGPT named the fused weight `attn.attn`, its rows interleaved per query group (for each group:
  its q heads, one k head, one v head). litgpt 0.5 reorders such a base when loading it
  (`qkv_reassemble`); a merge here does the same, reading the rows in the new order on demand, and writes
  `attn.qkv`. LoRA files with `attn.attn` names are refused by name (their deltas are in the old layout).
- `litgpt merge_lora` writes every tensor in the LoRA's dtype; `ckpt` does the same unless --to says.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ckpt.lazy import torch

from ckpt.errors import CkptError, file_error
from ckpt.io.checkpoint import open_checkpoint
from ckpt.io.file_kinds import LITGPT_LORA, NOT_WEIGHTS, WEIGHT_SUFFIXES
from ckpt.io.tensors import RowSlice, Tensor
from ckpt.adapters.files import LoraFile, LoraModule

LORA_FILE = "lit_model.pth.lora"
MODEL_FILE = "lit_model.pth"
HPARAMS = "hyperparameters.yaml"
MODEL_CONFIG = "model_config.yaml"
# What litgpt's own finetune script copies from the base folder (utils.copy_config_files).
CONFIG_FILES = ("config.json", "generation_config.json", "model_config.yaml",
                "tokenizer.json", "tokenizer.model", "tokenizer_config.json")
LEGACY_QKV = ".attn.attn."


@dataclass
class LitSettings:
    """The LoRA and attention facts a merge needs, with the files they came from."""

    r: int
    alpha: float
    qkv_enabled: tuple[bool, bool, bool]
    n_head: int
    n_query_groups: int
    head_size: int
    files: list[Path] = field(default_factory=list)

    @property
    def qkv_rows(self) -> tuple[tuple[int, int], ...]:
        """[start, stop) rows of Q, K and V in the fused `attn.qkv.weight`."""
        q, kv = self.n_head * self.head_size, self.n_query_groups * self.head_size
        return (0, q), (q, q + kv), (q + kv, q + 2 * kv)


def is_lora(path: Path) -> bool:
    """A LitGPT LoRA file, or a finetune folder holding one."""
    return path.name.endswith(LITGPT_LORA) or (path.is_dir() and (path / LORA_FILE).is_file())


def lora_path(path: Path) -> Path:
    return path / LORA_FILE if path.is_dir() else path


def _yaml(path: Path) -> dict:
    import yaml

    try:
        d = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise file_error(path, f"not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(d, dict):
        raise file_error(path, "not a YAML mapping")
    return d


def _int(d: dict, key: str, path: Path, default=None) -> int:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise file_error(path, f"{key} must be a positive integer (found {v!r})")
    return v


def read_settings(lora_file: Path, base_hint: Path | None = None) -> LitSettings:
    """hyperparameters.yaml beside the LoRA (required: it alone holds lora_alpha), model_config.yaml beside
    it or beside the base."""
    folder = lora_file.parent
    hp_path = folder / HPARAMS
    if not hp_path.is_file():
        raise file_error(lora_file, f"a LitGPT LoRA needs {HPARAMS} beside it (lora_r, lora_alpha, which "
                         "projections carry LoRA); it is written by litgpt finetune lora")
    hp = _yaml(hp_path)
    candidates = [folder / MODEL_CONFIG] + ([base_hint / MODEL_CONFIG] if base_hint else [])
    cfg_path = next((p for p in candidates if p.is_file()), None)
    if cfg_path is None:
        raise file_error(lora_file, f"no {MODEL_CONFIG} beside it{' or the base' if base_hint else ''} "
                         "(n_head, n_query_groups, head_size place the q/k/v deltas)")
    cfg = _yaml(cfg_path)
    cfg.update({k: v for k, v in hp.items() if k.startswith("lora_")})  # as litgpt: Config.from_file(**lora_params)
    n_head = _int(cfg, "n_head", cfg_path)
    # litgpt's Config defaults: head_size = n_embd // n_head, n_query_groups = n_head
    if cfg.get("head_size") is None:
        cfg["head_size"] = _int(cfg, "n_embd", cfg_path) // n_head
    if cfg.get("n_query_groups") is None:
        cfg["n_query_groups"] = n_head
    alpha = cfg.get("lora_alpha", 1)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha == 0:
        raise file_error(hp_path, f"lora_alpha must be a non-zero number (found {alpha!r})")
    return LitSettings(
        r=_int(cfg, "lora_r", hp_path, 0), alpha=float(alpha),
        qkv_enabled=tuple(bool(cfg.get(f"lora_{p}", False)) for p in ("query", "key", "value")),
        n_head=n_head, n_query_groups=_int(cfg, "n_query_groups", cfg_path),
        head_size=_int(cfg, "head_size", cfg_path), files=[hp_path, cfg_path])


def finetune_inputs(base: str, loras: list[str]) -> tuple[str, list[str], Path | None]:
    """`ckpt merge-lora FINETUNE_DIR` or `ckpt merge-lora FINETUNE_DIR/lit_model.pth.lora` alone:
    (base lit_model.pth, [the LoRA], the finetune folder); else unchanged."""
    path = Path(base).expanduser()
    if loras:
        return base, loras, None
    if path.is_dir() and (path / LORA_FILE).is_file():
        return str(base_of(path)), [str(path / LORA_FILE)], path
    if path.is_file() and path.name.endswith(LITGPT_LORA):
        return str(base_of(path.parent)), [str(path)], path.parent
    return base, loras, None


def base_of(finetune_dir: Path) -> Path:
    """The base `lit_model.pth` a finetune folder was trained from (hyperparameters.yaml checkpoint_dir,
    resolved the way litgpt does: as written, else under `checkpoints/`)."""
    hp_path = finetune_dir / HPARAMS
    if not hp_path.is_file():
        raise file_error(finetune_dir, f"has {LORA_FILE} but no {HPARAMS} (it names the base model; litgpt "
                         f"finetune lora writes it): name the base: ckpt merge-lora BASE/{MODEL_FILE} LORA")
    written = _yaml(hp_path).get("checkpoint_dir")
    if not written:
        raise file_error(hp_path, f"has no checkpoint_dir; name the base: ckpt merge-lora BASE/{MODEL_FILE} "
                         f"{finetune_dir}")
    d = Path(str(written)).expanduser()
    for cand in (d, Path("checkpoints") / d):
        if (cand / MODEL_FILE).is_file():
            return cand / MODEL_FILE
    raise CkptError(f"{finetune_dir}: its base model {d / MODEL_FILE} ({HPARAMS} checkpoint_dir) was not found "
                    f"from {Path.cwd()}; name it: ckpt merge-lora BASE/{MODEL_FILE} {finetune_dir}")


def load(spec: str, base_hint: Path | None = None):
    """A LitGPT LoRA as a `LoraFile` of plain LoRA modules (the fused q/k/v one split into its pieces)."""
    path = lora_path(Path(spec).expanduser())
    if not path.is_file():
        raise CkptError(f"{spec}: no {LORA_FILE} there")
    settings = read_settings(path, base_hint)
    ckpt = open_checkpoint(str(path))
    try:
        tensors = ckpt.components[0].tensors
        legacy = [k for k in tensors if LEGACY_QKV in k]
        if legacy:
            raise file_error(path, f"uses older LitGPT key names ({legacy[0]!r}: fused q/k/v named attn.attn, "
                             "rows interleaved per query group); ckpt merges attn.qkv LoRAs only: merge it with "
                             "the litgpt version that trained it")
        pairs: dict[str, dict[str, str]] = {}
        unknown = []
        for key in tensors:
            head, _, last = key.rpartition(".")
            if last in ("lora_A", "lora_B") and head:
                pairs.setdefault(head, {})[last] = key
            else:
                unknown.append(key)
        modules: dict[str, LoraModule] = {}
        for name, keys in pairs.items():
            if len(keys) != 2:
                raise file_error(path, f"module {name!r} has {', '.join(keys)} only (needs lora_A and lora_B)")
            A, B = tensors[keys["lora_A"]], tensors[keys["lora_B"]]
            if len(A.shape) != 2 or len(B.shape) != 2:
                raise file_error(path, f"module {name!r}: lora_A {list(A.shape)} / lora_B {list(B.shape)} are not 2-D")
            ks = [keys["lora_A"], keys["lora_B"]]
            if name.endswith(".attn.qkv"):
                for label, piece in _qkv_pieces(name, A, B, settings, path):
                    modules[f"{name} ({label})"] = LoraModule(name, spec, "lora", piece[0], ks, [name],
                                                              config_alpha=settings.alpha, rows=piece[1])
            else:
                if A.shape[0] != settings.r:
                    raise file_error(path, f"module {name!r}: lora_A has {A.shape[0]} rows, {HPARAMS} lora_r is "
                                     f"{settings.r}")
                modules[name] = LoraModule(name, spec, "lora", {"down": A, "up": B}, ks, [name],
                                           config_alpha=settings.alpha)
        if not modules:
            raise file_error(path, "holds no lora_A / lora_B tensors")
        # litgpt merge_lora writes the merged model in the dtype of the LoRA file's first tensor
        return LoraFile(spec, path, modules, unknown, ckpt, litgpt=settings,
                        dtype=next(iter(tensors.values())).dtype)
    except BaseException:
        ckpt.close()
        raise


def _qkv_pieces(name, A, B, s: LitSettings, path):
    """(label, ({"down": A_i, "up": B_i}, (start, stop, total rows))) for each enabled projection."""
    enabled = [(label, rows) for label, on, rows in zip("qkv", s.qkv_enabled, s.qkv_rows) if on]
    total = s.qkv_rows[2][1]
    want_b = sum(b - a for _, (a, b) in enabled)
    if not enabled or A.shape[0] != s.r * len(enabled) or B.shape[0] != want_b or B.shape[1] != s.r:
        flags = ", ".join(f"lora_{p}={on}" for p, on in zip(("query", "key", "value"), s.qkv_enabled))
        raise file_error(path, f"module {name!r}: lora_A {list(A.shape)} / lora_B {list(B.shape)} do not fit "
                         f"{flags}, lora_r={s.r} with n_head={s.n_head}, n_query_groups={s.n_query_groups}, "
                         f"head_size={s.head_size} (from {', '.join(str(p) for p in s.files)})")
    out, b0 = [], 0
    for i, (label, (a, b)) in enumerate(enabled):
        parts = {"down": RowSlice(A, i * s.r, (i + 1) * s.r), "up": RowSlice(B, b0, b0 + b - a)}
        out.append((label, (parts, (a, b, total))))
        b0 += b - a
    return out


class GroupedQKV(Tensor):
    """An older `attn.attn` weight or bias read as `attn.qkv`: rows reordered from per-group interleaved
    [q_g, k_g, v_g]... to [all q, all k, all v] (litgpt's qkv_reassemble), one contiguous run at a time."""

    def __init__(self, base: Tensor, name: str, s: LitSettings):
        q_per_kv, hs = s.n_head // s.n_query_groups, s.head_size
        block = (q_per_kv + 2) * hs
        if s.n_head % s.n_query_groups or not base.shape or base.shape[0] != s.n_query_groups * block:
            raise CkptError(f"{base.name}: {list(base.shape)} does not fit n_head={s.n_head}, "
                            f"n_query_groups={s.n_query_groups}, head_size={s.head_size}")
        self.base, self.name, self.dtype, self.shape, self.home = base, name, base.dtype, tuple(base.shape), base.home
        self.runs = []  # (first output row, first source row, rows) in output order
        out = 0
        for offset, length in ((0, q_per_kv * hs), (q_per_kv * hs, hs), ((q_per_kv + 1) * hs, hs)):
            for g in range(s.n_query_groups):
                self.runs.append((out, g * block + offset, length))
                out += length

    def natural_source(self):
        return self.base

    def read(self, start, stop, device, scratch=None):
        pieces = []
        for out, src, n in self.runs:
            a, b = max(start, out), min(stop, out + n)
            if a < b:
                pieces.append(self.base.read(src + a - out, src + b - out, device))
        return torch.cat(pieces) if len(pieces) != 1 else pieces[0]


def current_layout(views, s: LitSettings) -> list[str]:
    """Rename and reorder older `attn.attn` fused weights in the base's views to `attn.qkv`, as litgpt
    loads them. Returns a note when something changed."""
    n = 0
    for view in views:
        if not any(LEGACY_QKV in k for k in view.tensors):
            continue
        renamed = {}
        for k, t in view.tensors.items():
            if LEGACY_QKV in k and k.endswith((".attn.attn.weight", ".attn.attn.bias")):
                new = k.replace(".attn.attn.", ".attn.qkv.")
                renamed[new] = GroupedQKV(t, new, s)
                n += 1
            else:
                renamed[k] = t
        view.tensors.clear()
        view.tensors.update(renamed)
    return [f"{n} older LitGPT attn.attn tensors written as attn.qkv (rows regrouped as litgpt loads them)"] if n else []


def sidecars(finetune_dir: Path, base_dir: Path | None) -> list[tuple[Path, str]]:
    """Files a merged LitGPT folder carries: the finetune folder's own (configs, tokenizer, prompt style,
    hyperparameters), plus litgpt's config and tokenizer files it lacks from the base folder."""
    out = {}
    for p in sorted(finetune_dir.iterdir()):
        if p.is_file() and not p.name.startswith(".") and not p.name.endswith(WEIGHT_SUFFIXES + (LITGPT_LORA,)) \
                and not NOT_WEIGHTS.search(p.name):
            out[p.name] = p
    if base_dir is not None:
        for n in CONFIG_FILES:
            if n not in out and (base_dir / n).is_file():
                out[n] = base_dir / n
    return [(p, n) for n, p in out.items()]


def as_folder(plan, weights_name: str, copies: list[tuple[Path, str]]) -> None:
    """Turn a one-file plan into a LitGPT checkpoint folder: the weights plus the sidecars."""
    plan.single_file = False
    plan.files[0].relpath = weights_name
    plan.files[0].archive = Path(weights_name).stem
    plan.copies = list(copies)

