"""`ckpt merge-lora --keep-format`: the merged model in the base's own stored encoding and container.

The plan is made over the base's stored keys, not its logical tensors: every stored key is written again in
stored order, in its own file (shard) and dtype, with the file's metadata, GGUF key-values and sidecars
(`quanto_qmap.json`, `config.json` with its `quantization_config`) unchanged. A stored key is either

- copied as it is stored (codes, scales, markers, configs: byte for byte), when the LoRA does not change the
  logical tensor it belongs to; or
- written by the changed tensor's `Encoding` (`ckpt.quant.encoding`): the base value decoded, the patches
  applied in fp32 (`MergedTensor`), and the result encoded into exactly the stored keys it came from, in the
  same format and block layout, with scales computed from the merged values as that format's reference
  encoder computes them (per format: the encodings' docstrings, docs/merge-lora.md "Keep a quantized base in its format"), except
  the calibrated integer grids of GPTQ, AWQ and compressed-tensors int, whose scales and zero points are kept
  and only the codes re-rounded (`ckpt.quant.int_pack_encode`). A LoRA merges into an LLM-quantization
  weight as a plain merge does: from the value its library computes (`strategies.as_computed`).

Each encoding measures its requantization error on the codes it writes (an `ErrorMeter` per changed tensor),
which the command reports after writing.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ckpt import __version__
from ckpt.errors import CkptError
from ckpt.io.checkpoint_plan import plan_checkpoint
from ckpt.io.plan import OutFile, OutTensor, Plan
from ckpt.io.tensors import Tensor
from ckpt.quant.encoding import ErrorMeter, encoding_of
from ckpt.quant.view import View
from ckpt.report import Report, plural


def container(ckpt) -> str:
    """The base's own container: "gguf", "torch" (every weight file a torch pickle) or "safetensors"."""
    kinds = {f.kind for c in ckpt.components for f in c.files}
    if "gguf" in kinds:
        return "gguf"
    return "torch" if kinds == {"pickle"} else "safetensors"


def refuse_plain(ckpt, views) -> None:
    """--keep-format needs a stored encoding to keep."""
    if not any(v.formats for v in views):
        raise CkptError(f"--keep-format: {ckpt.spec} stores plain tensors (no quantized encoding to keep); "
                        "merge without --keep-format (--to chooses the dtype)")


def as_stored(t: Tensor) -> OutTensor:
    """A stored key written again unchanged: its stored dtype, shape and bytes (GGUF: type and blocks)."""
    from ckpt.io.gguf import GGUFStored

    if isinstance(t, GGUFStored):
        from ckpt.quant.gguf import stored_output

        return stored_output(t)
    return OutTensor(t.name, t.dtype, tuple(t.shape), t)


class _AtHome(Tensor):
    """A re-encoded key's source placed in the file its stored key lives in (sharded bases)."""

    def __init__(self, base: Tensor, home: str):
        self.base, self.home = base, home
        self.name, self.dtype, self.shape, self.row_align = base.name, base.dtype, tuple(base.shape), base.row_align

    @property
    def source_bytes(self):
        return self.base.source_bytes

    def read(self, start, stop, device, scratch=None):
        return self.base.read(start, stop, device, scratch)


def _conform(o: OutTensor, stored: Tensor, label: str, resizes: bool = False) -> OutTensor:
    """The re-encoded key as the stored key is: same dtype and shape (a byte-compatible view where the base
    stored e.g. fp8 codes as U8 or scales flattened), in the stored key's file; an encoding that `resizes` its
    keys keeps their dtype only."""
    want = as_stored(stored)
    src = o.source if o.source.home == stored.home else _AtHome(o.source, stored.home)
    if resizes and want.gguf_type is None and o.dtype == want.dtype and len(o.shape) == len(want.shape):
        return replace(o, source=src)
    if want.gguf_type is not None or o.gguf_type is not None:  # GGUF: same stored shape; the type may change
        if tuple(o.shape) != tuple(want.shape):
            raise CkptError(f"--keep-format: {o.name!r}: the {label} encoder writes shape {list(o.shape)}, "
                            f"stored is {list(want.shape)}")
        return replace(o, source=src)
    if o.dtype == want.dtype and tuple(o.shape) == tuple(want.shape):
        return replace(o, source=src)
    if o.dtype.itemsize == want.dtype.itemsize and math.prod(o.shape) == math.prod(want.shape):
        cast, dt = o.cast, want.dtype
        if cast is None:
            return OutTensor(o.name, dt, tuple(want.shape), src, lambda x, b: x.view(dt))
        return OutTensor(o.name, dt, tuple(want.shape), src, lambda x, b: cast(x, b).view(dt))
    raise CkptError(f"--keep-format: {o.name!r} is stored as {want.dtype} {list(want.shape)}, but the {label} encoder "
                    f"writes {o.dtype} {list(o.shape)}; this layout cannot be re-encoded; nothing was written")


class Reencoded(Tensor):
    """A stored key the merge re-encodes, standing in the stored view with its output: a plan's `make` sees
    one tensor at a time, so the output travels on it (stored names repeat across a pipeline's components)."""

    def __init__(self, stored: Tensor, out: OutTensor):
        self.stored, self.out = stored, out
        self.name, self.dtype, self.shape, self.home = stored.name, stored.dtype, tuple(stored.shape), stored.home


def plan_keep_format(ckpt, views, changed: list[dict[str, Tensor]], report: Report, operation: str,
                     file_format: str) -> tuple[Plan, list[ErrorMeter], list[str]]:
    """The plan (stored keys in stored order, changed tensors re-encoded), one ErrorMeter per changed tensor,
    and the notes to print. `changed`: per component, view key -> the new value of that logical tensor (merge-lora's
    `MergedTensor`, a model merge's `MergedModelTensor`), encoded as the stored tensor it replaces."""
    refuse_plain(ckpt, views)
    meters: list[ErrorMeter] = []
    notes: list[str] = []
    replaced: list[dict[str, OutTensor]] = []  # per component: stored key -> its re-encoded output
    for comp, view, comp_changed in zip(ckpt.components, views, changed):
        where = f"{comp.subdir}/" if comp.subdir else ""
        done: dict[str, OutTensor] = {}
        replaced.append(done)
        for key, t in view.tensors.items():
            if key not in comp_changed:
                continue
            enc = encoding_of(t)
            if enc is None:
                raise CkptError(f"--keep-format: {where}{t.name} is decoded from {', '.join(view.formats)}, which "
                                "ckpt cannot encode again; nothing was written (merge without --keep-format for "
                                "a plain file)")
            why = enc.why_not()
            if why:
                raise CkptError(f"--keep-format: {where}{t.name} ({enc.label}) cannot be re-encoded: {why}; "
                                "nothing was written")
            meter = ErrorMeter(f"{where}{t.name}", enc.label)
            for o in enc.encode(comp_changed[key], report, meter):
                stored = comp.tensors.get(o.name)
                if stored is None or o.name in done:
                    raise RuntimeError(f"{o.name}: the {enc.label} encoding writes a key the base does not store once")
                done[o.name] = _conform(o, stored, enc.label, enc.resizes)
            meters.append(meter)
            if enc.note and enc.note not in notes:
                notes.append(enc.note)

    def make(t: Tensor) -> list[OutTensor]:
        return [t.out if isinstance(t, Reencoded) else as_stored(t)]

    stored = [{k: Reencoded(t, done[k]) if k in done else t for k, t in c.tensors.items()}
              for c, done in zip(ckpt.components, replaced)]
    n_stored = sum(len(c.tensors) for c in ckpt.components)
    n_replaced = sum(len(done) for done in replaced)
    formats = sorted({f for v in views for f in v.formats})
    notes.append(f"kept the base's encoding ({', '.join(formats)}): {plural(len(meters), 'changed tensor')} "
                 f"re-encoded into {plural(n_replaced, 'stored key')}, {n_stored - n_replaced} of "
                 f"{plural(n_stored, 'stored key')} copied unchanged")
    if file_format == "gguf":
        return _plan_gguf(ckpt, stored[0], make, operation), meters, notes
    stored_views = [View(tensors, {}, [], set(), False, [], None) for tensors in stored]
    plan = plan_checkpoint(ckpt, stored_views, make, operation=operation, file_format=file_format)
    return plan, meters, notes


def _plan_gguf(ckpt, tensors: dict[str, Tensor], make, operation: str) -> Plan:
    """One GGUF file: the base's key-values (exact types, order) plus ckpt's provenance, tensors in order."""
    from ckpt.io.gguf_writer import fields_from, string

    comp = ckpt.components[0]
    header = comp.files[0].gguf
    fields = [f for f in fields_from(header) if f.key not in ("ckpt.version", "ckpt.operation")]
    fields += [string("ckpt.version", __version__), string("ckpt.operation", operation)]
    outs = [o for t in tensors.values() for o in make(t)]
    return Plan(single_file=True, files=[OutFile("", {}, outs, "gguf", fields=fields)])


def summarize(meters: list[ErrorMeter], worst: int = 3) -> tuple[list[str], dict]:
    """Summary lines (mean and worst relative RMS) and the `--report` JSON part."""
    if not meters:
        return [], {}
    errs = [(m.rel_rms, m) for m in meters]
    finite = [e for e, _ in errs if math.isfinite(e)]
    mean = sum(finite) / len(finite) if finite else 0.0
    kinds: dict[str, int] = {}
    for m in meters:
        kinds[m.label] = kinds.get(m.label, 0) + 1
    shown = sorted(errs, key=lambda em: -em[0])[:worst]
    lines = [f"re-encoded {plural(len(meters), 'changed tensor')} in the base's format "
             f"({', '.join(f'{k} {n}' for k, n in sorted(kinds.items(), key=lambda kv: -kv[1]))})",
             "requantization error (relative RMS of decode(encode(merged)) vs the fp32 merge): "
             f"mean {_pct(mean)}, worst " + ", ".join(f"{m.name} {_pct(e)} ({m.label})" for e, m in shown)]
    facts = {"mean_rel_rms": mean,
             "tensors": {m.name: {"format": m.label, "rel_rms": e if math.isfinite(e) else None} for e, m in errs}}
    return lines, facts


def _pct(x: float) -> str:
    if not math.isfinite(x):
        return "inf"
    return f"{x * 100:.3g}%"
