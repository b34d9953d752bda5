"""The logical view of one component: plain tensors, with scale and marker keys consumed.

Every registered format's decoders (`ckpt.quant.formats`: `decode(ctx) -> Decoded | None`) run in the formats'
priority order over the keys no earlier decoder claimed; what a decoder consumes is recorded with the reason, so
nothing disappears silently. Afterwards, keys that still look like quantization data the decoders did not
understand (the formats' `refusals`), or data whose method config.json contradicts (`contradicts`), stop the
run with an error naming the format (before any output exists).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ckpt.errors import CkptError
from ckpt.io.checkpoint import Component
from ckpt.io.tensors import Tensor
from ckpt.quant.common import DecodeContext, quant_config
from ckpt.quant.formats import contradictions, decoders, refusals


@dataclass
class View:
    tensors: dict[str, Tensor]
    consumed: dict[str, str]
    formats: list[str]
    drop_metadata: set[str]
    dequantized: bool
    notes: list[str]
    config: dict | None = None  # config.json made from the stored encoding (written beside the weights)
    anchors: dict[str, str] = field(default_factory=dict)  # consumed stored key -> logical name it holds
    origin: View | None = None  # a view a command made of another (merged tensors in place): the decoded one


def _contradiction(component: Component, ctx: DecodeContext) -> None:
    """Refuse stored data of one format under a quantization_config naming another (the formats' `contradicts`)."""
    qc = quant_config(ctx)
    if not qc:  # no quantization_config: the decoders go by the tensors' own names
        return
    method = qc.get("quant_method")
    for key in ctx.remaining:
        for c in contradictions():
            if not c.found(key, ctx.remaining):
                continue
            if method is None:
                raise CkptError(f"{component.where}: config.json's quantization_config names no quant_method, but "
                                f"the tensors are {c.what} ({key!r}; quant_method {c.method}); nothing was written")
            shown = str(method) if len(str(method)) <= 40 else str(method)[:40] + "..."
            raise CkptError(f"{component.where}: config.json's quant_method {shown!r} contradicts the tensors, "
                            f"which are {c.what} ({key!r}; quant_method {c.method}); nothing was written")


def logical_view(component: Component, options: dict | None = None) -> View:
    metadata: dict[str, str] = {}
    for f in component.files:
        metadata.update(f.metadata)
    ctx = DecodeContext(component, dict(component.tensors), metadata, component.config, options or {})
    tensors: dict[str, Tensor] = {}
    consumed: dict[str, str] = {}
    formats, notes, drop_meta = [], list(component.notes), set()
    dequantized = False
    anchors: dict[str, str] = {}
    config = None
    for decode in decoders():
        d = decode(ctx)
        if d is None:
            continue
        formats.append(d.format)
        notes += d.notes
        drop_meta |= d.drop_metadata
        dequantized |= d.dequantized
        for key in d.consumed:
            ctx.remaining.pop(key, None)
        for name in d.tensors:
            ctx.remaining.pop(name, None)
        consumed.update(d.consumed)
        tensors.update(d.tensors)
        anchors.update(d.anchors)
        config = d.config if d.config is not None else config
    _contradiction(component, ctx)
    for key in ctx.remaining:
        for fmt, (pattern, why) in refusals().items():
            if pattern.search(key):
                raise CkptError(f"{component.where}: {fmt} quantization ({key!r}): {why}; nothing was written")
    # Keep the stored order: decoded tensors take the place of the key they decode.
    ordered = {}
    for key, t in component.tensors.items():
        if key in tensors:
            ordered[key] = tensors.pop(key)
        elif key in ctx.remaining:
            ordered[key] = ctx.remaining[key]
        elif anchors.get(key) in tensors:
            ordered[anchors[key]] = tensors.pop(anchors[key])
    ordered.update(tensors)  # decoded names with no stored key of their own (e.g. quanto X.weight)
    return View(ordered, consumed, formats, drop_meta, dequantized, notes, config, anchors)
