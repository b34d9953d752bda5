"""`ckpt lora extract BASE TUNED`: a LoRA approximating TUNED - BASE, one weight at a time.

Both checkpoints are read through the same views as every command (FP8 layouts and quanto decoded),
paired by name, component by component; shapes must agree and every weight must have its counterpart
(a different family or layout is an error, not a partial LoRA). For each weight the delta is formed in
fp32 on the work device from row bands of both (two band buffers, one delta), decomposed (full
`torch.linalg.svd`, or `torch.svd_lowrank` with --lowrank), cut to its rank, optionally clamped, cast
to the save dtype, measured, and spilled to the scratch store; memory is one delta and its SVD at a
time. When every module is done the output is planned from the factors' shapes and written
header-first (`ckpt.lora.store`).

Which weights: the floating `.weight` tensors of 2 or more dimensions (Linear, Conv; conv layers as
LoCon: down [r, in, kh, kw], up [out, r, 1, 1]) of the diffusion model and text encoders; every other
tensor that changed (biases, norms, a VAE) is listed, never silently dropped. A weight whose delta has
max |dW| <= --min-diff (default 0: unchanged) is skipped and listed; a weight with no elements ([32, 0])
has no delta and is skipped with a note. A NaN/Inf in either weight makes its SVD fail: a one-line error
naming the file and weight, or with --skip-nonfinite the weight is left out and its values counted.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
from pathlib import Path

from ckpt.lazy import torch

from ckpt.devices import exact_fp32, resolve_device
from ckpt.dtypes import is_float
from ckpt.errors import CkptError
from ckpt.io.checkpoint import open_checkpoint
from ckpt.io.buffers import Buffers
from ckpt.io import output
from ckpt.io.output import bands
from ckpt.io.plan import Plan
from ckpt.io.tensors import row_bands
from ckpt.lora import svd as S
from ckpt.lora.common import LoraOptions, LoraReport, ModuleResult, early_target_check, nothing_left
from ckpt.lora.formats import FORMATS, Layout, OutModule, plan_lora
from ckpt.lora.modules import to_layout
from ckpt.lora.naming import Naming
from ckpt.lora.operations import lora_extract_operation
from ckpt.lora.store import FactorStore
from ckpt.adapters.checks import finite
from ckpt.progress import progress_bar
from ckpt.quant.view import logical_view
from ckpt.report import listed, plural
from ckpt.run import default_output, human_size, output_path, write


def extract(base: str, tuned: str, out: str | Path | None, opts: LoraOptions, *, min_diff: float = 0.0,
            exclude: list[str] = (), report: LoraReport | None = None) -> tuple[Path, LoraReport]:
    """Extract TUNED - BASE as a LoRA; returns (output path, report). Raises CkptError on bad input."""
    report = report or LoraReport()
    opts.check()
    finite("--min-diff", min_diff)
    if min_diff < 0:
        raise CkptError(f"--min-diff {min_diff}: at least 0")
    if opts.format is not None and opts.format not in FORMATS:
        raise CkptError(f"--format {opts.format}: choose one of {', '.join(FORMATS)}")
    device = resolve_device(opts.device)
    with contextlib.ExitStack() as stack:
        b = stack.enter_context(open_checkpoint(base))
        t = stack.enter_context(open_checkpoint(tuned))
        fmt = opts.format or _default_format(b)
        jobs, others, namings = _pair(b, t, fmt, exclude, base, tuned)
        _check_ranks(jobs, opts)
        layout = Layout.of(fmt, tuple(sorted({p for n in namings for p in n.prefixes})))
        derived = default_output(tuned, t.path, "lora", folder=layout.container == "folder")
        out_path = output_path(out, derived, Plan(single_file=layout.container == "file", files=[]))
        inputs = b.inputs + t.inputs
        early_target_check(out_path, inputs, opts.overwrite, layout.container == "file", opts.dry_run)
        op = lora_extract_operation(base, tuned, opts, min_diff, exclude)
        if opts.dry_run:
            return _dry_run(jobs, opts, fmt, layout, out_path, report), report
        store = stack.enter_context(FactorStore(out_path))
        modules = _decompose(jobs, opts, layout, device, store, report, min_diff, (base, tuned))
        _changed_others(others, device, report)
        report.finish("extracted")
        if not modules and report.nonfinite:
            nothing_left(tuned, modules, report)
        if not modules:
            raise CkptError(f"{tuned}: no weight differs from {base} by more than --min-diff {min_diff:g}; "
                            "nothing to extract, nothing written")
        meta = _kohya_metadata(opts) if fmt == "kohya" else {}
        model = {p.name for n in namings for g in n.groups if g.pieces for p in g.pieces}
        plan = plan_lora(modules, layout, lambda x: x.dtype, op, meta, report, model_names=model)
        write(plan, out_path, inputs=inputs, report=report, desc="lora extract", device=torch.device("cpu"),
              overwrite=opts.overwrite, dry_run=False, quiet=opts.quiet)
    return out_path, report


def _default_format(ckpt) -> str:
    """What the base's users expect: a PEFT adapter for a transformers model folder, kohya otherwise."""
    if len(ckpt.components) == 1:
        cfg = ckpt.components[0].config or {}
        if cfg.get("architectures") or (cfg.get("model_type") and "_class_name" not in cfg):
            return "peft"
    return "kohya"


class _Job:
    """One output group: base weights and their tuned counterparts (stacked by rows when a fused module
    is made of several), and the pieces the output naming cuts from the stacked delta."""

    def __init__(self, keys, bases, tuneds, pieces, reason):
        self.keys, self.bases, self.tuneds, self.pieces, self.reason = keys, bases, tuneds, pieces, reason
        self.shape = (sum(t.shape[0] for t in bases),) + tuple(bases[0].shape[1:])

    @property
    def key(self) -> str:
        return " + ".join(self.keys)

    @property
    def conv(self) -> bool:
        return len(self.shape) > 2 and math.prod(self.shape[2:]) > 1

    @property
    def source_bytes(self) -> int:
        return sum(t.source_bytes for t in self.bases + self.tuneds)

    def module_shape(self, p) -> tuple[int, ...]:
        """The weight shape of piece `p`'s module in its own layout: its rows of the stack, through the
        family's transform (`Transform.shape`)."""
        rows = self.shape[0] if p.rows is None else p.rows[1] - p.rows[0]
        shape = (rows,) + tuple(self.shape[1:])
        return shape if p.transform is None else p.transform.shape(shape)

    def piece_shape(self, p) -> tuple[int, int]:
        """(rows, flattened columns) of piece `p`'s delta in its module's layout (`Piece.of`)."""
        shape = self.module_shape(p)
        return shape[0], math.prod(shape[1:])


def _pair(b, t, fmt, exclude, base_spec, tuned_spec):
    """Jobs for every extractable group of weights, the other paired tensors (checked for change only),
    and the namings. Any weight without a counterpart, or with another shape, is an error."""
    bsubs = {c.subdir: c for c in b.components}
    tsubs = {c.subdir: c for c in t.components}
    if set(bsubs) != set(tsubs):
        raise CkptError(f"{tuned_spec}: its components ({', '.join(sorted(tsubs)) or 'one model'}) differ from "
                        f"{base_spec}'s ({', '.join(sorted(bsubs)) or 'one model'}): not the same model family")
    jobs, others, namings = [], [], []
    single = len(bsubs) == 1
    for sub in sorted(bsubs):
        bv, tv = logical_view(bsubs[sub]), logical_view(tsubs[sub])
        where = f"{sub}/" if sub else ""
        only_b = [k for k in bv.tensors if k not in tv.tensors and len(bv.tensors[k].shape) >= 2]
        only_t = [k for k in tv.tensors if k not in bv.tensors and len(tv.tensors[k].shape) >= 2]
        if only_b or only_t:
            side, names = (base_spec, only_b) if only_b else (tuned_spec, only_t)
            other = tuned_spec if only_b else base_spec
            raise CkptError(f"{side}: {plural(len(names), 'weight')} {'has' if len(names) == 1 else 'have'} no "
                            f"counterpart in {other} (e.g. {where}{names[0]!r}): "
                            "not the same model family and layout")
        candidates = {}
        for k, bt in bv.tensors.items():
            tt = tv.tensors.get(k)
            if tt is None:
                continue
            if tuple(tt.shape) != tuple(bt.shape):
                raise CkptError(f"{tuned_spec}: {where}{k} is {list(tt.shape)} but {list(bt.shape)} in {base_spec}: "
                                "not the same model")
            if not (is_float(bt.dtype) and is_float(tt.dtype)):
                continue
            if any(fnmatch.fnmatchcase(where + k, pat) for pat in exclude):
                continue
            if len(bt.shape) >= 2:
                candidates[k] = (bt, tt)
            else:
                others.append((where + k, bt, tt))
        naming = Naming(fmt, {k: tuple(x.shape) for k, x in bv.tensors.items()}, sub, bsubs[sub].config, single)
        namings.append(naming)
        grouped = set()
        for g in naming.groups:
            if not all(k in candidates for k in g.keys):
                continue
            grouped.update(g.keys)
            jobs.append(_Job([where + k for k in g.keys], [candidates[k][0] for k in g.keys],
                             [candidates[k][1] for k in g.keys], g.pieces, g.reason))
        for k, (bt, tt) in candidates.items():
            if k not in grouped:  # a VAE's weights, tensors named otherwise: compared, listed if changed
                others.append((where + k, bt, tt))
    return jobs, others, namings


def _check_ranks(jobs, opts: LoraOptions) -> None:
    """--rank (--conv-rank) larger than every layer of its kind allows is a usage error."""
    for conv, flag, r in ((False, "--rank", opts.rank), (True, "--conv-rank", opts.conv_rank or opts.rank)):
        if r is None:
            continue
        caps = [min(j.piece_shape(p)) for j in jobs if j.conv == conv and j.pieces for p in j.pieces]
        if caps and r > max(caps):
            kind = "conv layer" if conv else "layer"
            raise CkptError(f"{flag} {r}: larger than any {kind} allows (the largest allows {max(caps)}: "
                            "min(out, in x kh x kw))")


def _dry_run(jobs, opts, fmt, layout, out_path, report) -> Path:
    n = sum(len(j.pieces) for j in jobs if j.pieces)
    most = 0
    for j in jobs:
        if not j.pieces:
            continue
        for p in j.pieces:
            rows, cols = j.piece_shape(p)
            k = min(opts.rule(j.conv, min(rows, cols)).rank, rows, cols)
            most += k * (rows + cols) * opts.dtype.itemsize
    report.summary.append(f"would extract up to {plural(n, 'module')} from {plural(len(jobs), 'weight')} in {fmt} naming "
                          f"({'adapter folder' if layout.container == 'folder' else 'one file'}), at most "
                          f"{human_size(most)}; ranks, skipped modules and errors are known after the SVDs")
    report.note(f"dry run: would write {out_path}")
    return out_path


def _read_delta(job: _Job, device, buffers: Buffers) -> torch.Tensor:
    """tuned - base in fp32 on `device`, [rows, prod(shape[1:])], filled one row band at a time (the
    weights of a fused group one below the other)."""
    delta = torch.empty((job.shape[0], math.prod(job.shape[1:])), dtype=torch.float32, device=device)
    at = 0
    for bt, tt in zip(job.bases, job.tuneds):
        for a, b in bands(tt):
            delta[at + a:at + b].copy_(tt.read(a, b, device, buffers).reshape(b - a, -1))
        for a, b in bands(bt):
            delta[at + a:at + b].sub_(bt.read(a, b, device, buffers).reshape(b - a, -1).to(torch.float32))
        at += bt.shape[0]
    return delta


def _nonfinite_inputs(job: _Job, device, buffers: Buffers, delta: torch.Tensor) -> dict[tuple[int, str], int]:
    """Where the NaN/Inf of a delta that is not finite come from: (0 = base / 1 = tuned, weight name) -> values
    that are NaN/Inf in fp32, tuned before base for each weight; finite inputs whose difference overflowed fp32
    count as the tuned first weight's. Every NaN/Inf input makes the delta NaN/Inf at its place, so only such a
    delta (told by `_max_abs`, which the --min-diff test computes anyway) has its inputs read again here."""
    bad: dict[tuple[int, str], int] = {}
    for key, bt, tt in zip(job.keys, job.bases, job.tuneds):
        for side, t in ((1, tt), (0, bt)):
            for a, b in bands(t):
                n = int((~torch.isfinite(t.read(a, b, device, buffers).to(torch.float32))).sum())
                if n:
                    bad[(side, key)] = bad.get((side, key), 0) + n
    if not bad:
        bad[(1, job.keys[0])] = int((~torch.isfinite(delta)).sum())
    return bad


def _max_abs(x: torch.Tensor) -> float:
    lo, hi = torch.aminmax(x)
    return max(-float(lo), float(hi))


def _decompose(jobs, opts: LoraOptions, layout: Layout, device, store: FactorStore, report: LoraReport,
               min_diff: float, specs: tuple[str, str]) -> list[OutModule]:
    modules: list[OutModule] = []
    buffers = Buffers()
    total = sum(j.source_bytes for j in jobs)
    dtype = opts.dtype
    with progress_bar(total, "lora extract (SVD)", opts.quiet) as bar, exact_fp32(), torch.no_grad():
        for job in jobs:
            delta = _read_delta(job, device, buffers)
            bar.update(job.source_bytes)
            if not delta.numel():  # a [32, 0] weight: no values, no delta
                report.empty.append(job.key)
                continue
            biggest = _max_abs(delta)
            if not math.isfinite(biggest):  # an SVD of NaN/Inf fails; a LoRA of it would be NaN
                bad = _nonfinite_inputs(job, device, buffers, delta)
                if not opts.skip_nonfinite:
                    (side, key), n = next(iter(sorted(bad.items(), key=lambda kv: -kv[0][0])))
                    raise CkptError(f"{specs[side]}: {key} holds {plural(n, 'NaN/Inf value')}: its delta cannot be "
                                    "decomposed; nothing written (pass --skip-nonfinite to leave such weights out)")
                for (side, key), n in bad.items():
                    report.count("nonfinite_skipped", key, n)
                report.nonfinite.append(job.key)
                continue
            if biggest <= min_diff:
                report.skipped.append(job.key)
                continue
            if not job.pieces:
                raise CkptError(f"{job.key} changed, but {job.reason}; nothing written (pass --exclude to leave "
                                "it out, or choose another --format)")
            for p in job.pieces:
                d = p.of(delta)
                rows, cols = d.shape
                cap = min(rows, cols)
                rule = opts.rule(job.conv, cap)
                U, sv, Vh = S.svd(d, min(rule.rank, cap), opts.svd)
                fro = S.fro_norm(d) if opts.lowrank else None
                k = rule.choose(sv, cap, fro)
                if rule.rank > cap and opts.dynamic is None:
                    report.capped.append(f"{p.name} ({cap})")
                up, down = S.factors(d, U, sv, Vh, k)
                del U, Vh
                if opts.clamp_quantile is not None:
                    S.clamp_quantile(up, down, opts.clamp_quantile)
                up, down = up.to(dtype), down.to(dtype)
                err, norm = S.error_of_whole(d, up.float(), down.float())
                own = job.module_shape(p)  # a conv module's factors keep its kernel dims
                keys = layout.embedding_keys(p.name) or {}
                upt, downt = to_layout(up, down, tuple(own[1:]), bool(keys))  # an embedding: PEFT's B, A
                m = OutModule(p.name, store.put(p.name + ".up", upt), store.put(p.name + ".down", downt),
                              layout.alpha_for(1.0, k), keys)
                modules.append(m)
                report.modules.append(ModuleResult(p.name, (rows, cols), k, cap, S.rel(err, norm), norm))
            del delta
    return modules


def _changed_others(others, device, report: LoraReport) -> None:
    """Tensors that have no LoRA form (biases, norms, VAE...): read and compared, and listed if changed."""
    changed = []
    tuned_buffers, base_buffers = Buffers(), Buffers()
    for key, bt, tt in others:
        for a, b in _common_bands(bt, tt):
            x = tt.read(a, b, device, tuned_buffers).to(torch.float32)
            y = bt.read(a, b, device, base_buffers).to(torch.float32)
            if not torch.equal(x, y):
                changed.append(key)
                break
    if changed:
        one = len(changed) == 1
        report.summary.append(f"{plural(len(changed), 'changed tensor')} {'has' if one else 'have'} no LoRA form and "
                              f"{'is' if one else 'are'} not in the output "
                              f"(biases, norms, embeddings, VAE...): {listed(changed)}")


def _common_bands(x, y):
    """Row bands both tensors accept (their decoders may need aligned starts)."""
    if x.row_align is None or y.row_align is None:
        return [(0, x.rows)]
    return list(row_bands(x.rows, x.row_numel, math.lcm(x.row_align, y.row_align), output.BAND_ELEMS))


def _kohya_metadata(opts: LoraOptions) -> dict[str, str]:
    dim = "Dynamic" if opts.dynamic else str(opts.rank)
    return {"ss_network_module": "networks.lora", "ss_network_dim": dim, "ss_network_alpha": dim}
