"""How a component's weights are stored, as inspect names them: plain, FP8 (dtype and layout), each quantized
format, and the per-setting layers of the LLM quantizations.

Every layout ckpt decodes is named by its decoder (`View.formats` of `ckpt.quant.view.logical_view`, the code
convert and dequant run; the formats are the registry `ckpt/quant/formats.py`), so inspect never disagrees with
what convert would do. Some layouts are also recognised from their stored keys, to count their weights and to
name them even where the decoder refuses the checkpoint (inspect reports what dequant would refuse):
optimum-quanto by its decoder's own key grouping (`ckpt.quant.quanto.stored_entries`), bitsandbytes by
`quant_state.bitsandbytes__nf4|fp4` and `SCB` (its state: `absmax`, `quant_map`, ...), GPTQ/AWQ packs by
`qweight` (with `qzeros`, `g_idx`, `scales`). `quantized_layers` asks the registered format of each decoded
weight (`ckpt.quant.formats.format_of`) for its settings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ckpt.dtypes import FP8, ST_FP8, short_name, st_short_name

QUANTO_ACTIVATION = re.compile(r"\.(input_scale|output_scale)$")
BNB_4BIT = re.compile(r"^(.*)\.quant_state\.bitsandbytes__(nf4|fp4)$")
BNB_AUX = re.compile(r"\.(absmax|quant_map|nested_absmax|nested_quant_map|quant_state\.[\w]+)$")
BNB_INT8 = re.compile(r"^(.*)\.SCB$")
GPTQ = re.compile(r"^(.*)\.qweight$")
GPTQ_AUX = re.compile(r"\.(qzeros|g_idx|scales)$")


@dataclass
class Encodings:
    names: list[str] = field(default_factory=list)  # e.g. ["fp8_e4m3fn", "comfy-scaled-fp8"], ["plain"]
    fp8: dict[str, int] = field(default_factory=dict)  # fp8 dtype name -> stored tensors
    quantized: dict[str, int] = field(default_factory=dict)  # "optimum-quanto qint8" -> weights
    aux_keys: set[str] = field(default_factory=set)  # scale / state keys of a quantized layout


def detect_encodings(tensors: dict, view, view_error: str | None, config, metadata, sidecars: dict) -> Encodings:
    """`tensors`: stored name -> Tensor; `view`: the component's logical view (None if it failed)."""
    enc = Encodings()
    _quanto(tensors, enc, sidecars.get("quanto_qmap.json"))
    for name in tensors:
        m = BNB_4BIT.match(name)
        if m:
            _add(enc, f"bitsandbytes {m.group(2)}")
        elif BNB_INT8.match(name):
            _add(enc, "bitsandbytes int8 (LLM.int8)")
        if BNB_AUX.search(name) or BNB_INT8.match(name):
            enc.aux_keys.add(name)
    qm = (config or {}).get("quantization_config") if isinstance(config, dict) else None
    method = qm.get("quant_method") if isinstance(qm, dict) else None
    for name in tensors:
        if GPTQ.match(name):
            _add(enc, f"{method.upper()} int packs" if method in ("gptq", "awq") else "GPTQ/AWQ-style int packs")
        if GPTQ.match(name) or (GPTQ_AUX.search(name) and name.rsplit(".", 1)[0] + ".qweight" in tensors):
            enc.aux_keys.add(name)
    if view is not None:
        enc.aux_keys |= set(view.consumed)
    for name, t in tensors.items():  # fp8 codes of a quantized layout (quanto qfloat8) are not fp8 weights
        if t.dtype_name in ST_FP8 and name not in enc.aux_keys:
            k = st_short_name(t.dtype_name)
            enc.fp8[k] = enc.fp8.get(k, 0) + 1
    decoded = [f for f in (view.formats if view is not None else []) if not any(n.startswith(f) for n in enc.names)]
    if view is not None and not any(r.startswith("activation scale") for r in view.consumed.values()):
        # this decoder also runs with no scales at all, only to retire an fp8 quantization_config
        decoded = [f for f in decoded if f != "fp8-activation-scales"]
    layout_known = bool(view is not None and view.formats)
    enc.names = decoded + [k if layout_known else f"{k} (plain, no scales)" for k in enc.fp8] + enc.names
    if ("_quantization_metadata" in metadata or any(n.endswith(".comfy_quant") for n in tensors)) \
            and not any("comfy" in n for n in enc.names):
        enc.names.append("ComfyUI comfy_quant (per-layer formats)")
    if method:
        extra = f", weight_block_size {qm['weight_block_size']}" if qm.get("weight_block_size") else ""
        enc.names.append(f"config.json quantization_config: {method}{extra}")
    if view_error:
        enc.names.append("not decodable by ckpt (see warnings)")
    if not enc.names:
        enc.names.append("plain")
    return enc


def _add(enc: Encodings, label: str, n: int = 1) -> None:
    if label not in enc.names:
        enc.names.append(label)
    enc.quantized[label] = enc.quantized.get(label, 0) + n


def _quanto(tensors: dict, enc: Encodings, qmap) -> None:
    """optimum-quanto weights, found by the decoder's own key grouping (`ckpt.quant.quanto`), labelled
    even when the decoder cannot resolve them (inspect reports what `dequant` would refuse)."""
    from ckpt.quant.quanto import stored_entries

    for e in stored_entries(tensors).values():
        t = e.data
        if e.packed:
            q = qmap.get(e.module, {}).get("weights") if qmap and isinstance(qmap.get(e.module), dict) else None
            label = f"optimum-quanto {q}" if isinstance(q, str) else "optimum-quanto qint4/qint2 (packed)"
        else:
            label = "optimum-quanto " + ("qfloat8" if t.dtype in FP8 else "qint8" if t.dtype.is_signed
                                         and not t.dtype.is_floating_point else f"({short_name(t.dtype)} data)")
        _add(enc, label)
        enc.aux_keys |= {k for k in (e.data_key, e.prefix + "._scale", e.shift_key) if k in tensors}
    if enc.quantized and any(k.startswith("optimum-quanto") for k in enc.quantized):
        enc.aux_keys |= {n for n in tensors if QUANTO_ACTIVATION.search(n)}


def quantized_layers(view, config) -> dict | None:
    """What the decoders of the formats with inspect `settings` (the LLM quantizations of `ckpt.quant.formats`:
    GPTQ, AWQ, compressed-tensors (its FP8 schemes too, decoded by the scaled-FP8 decoder), ModelOpt NVFP4,
    gpt-oss MXFP4, HQQ, torchao) decoded, per setting, and which tensors stay plain; None when none of them decoded
    anything.

    The settings are asked of the decoded tensors (`ckpt.quant.*` weights keep the bits, group size, zero
    points, strategy they decode with), so inspect names what `dequant` would do. GPTQ's sym flag is the one
    setting no decoded tensor carries (its zero points are stored either way): it comes from config.json's
    quantization_config when that says, else it is left out. Likewise a compressed-tensors scheme's activation
    quantization (`activations`: FP8_DYNAMIC's dynamic per-token fp8) and an FP8 scheme's strategy and block
    structure come from its config group, the only place they are written down.

        {"layers": [{"label": "GPTQ 4-bit, group 32, asym, act-order, v1 zero points", "tensors": n,
                     "settings": {"format": "GPTQ", "bits": 4, "group_size": 32, ...}}, ...],
         "unquantized": {"tensors": n, "matrices": [names of the plain tensors of 2+ dims]}}
    """
    if view is None:
        return None
    layers: dict[str, dict] = {}
    plain: list[str] = []
    for name, t in view.tensors.items():
        s = _settings(t, config)
        if s is None:
            plain.append(name)
            continue
        label = _label(s)
        entry = layers.setdefault(label, {"label": label, "tensors": 0, "settings": s})
        entry["tensors"] += 1
    if not layers:
        return None
    matrices = [n for n in plain if len(view.tensors[n].shape) >= 2]
    return {"layers": list(layers.values()), "unquantized": {"tensors": len(plain), "matrices": matrices}}


def _settings(t, config) -> dict | None:
    """What the format that decoded `t` says of it (`ckpt.quant.formats`: each format's `settings`), or None."""
    from ckpt.quant.formats import format_of

    fmt = format_of(t)
    return fmt.settings(t, config) if fmt is not None and fmt.settings is not None else None


def _label(s: dict) -> str:
    """One line per setting combination: "GPTQ 4-bit, group 128, sym, act-order (g_idx), v1 zero points"; the
    head is the decoder's own name of the format (`View.formats`)."""
    fmt = s["format"]
    if "type" in s:  # as the decoders name them: "ModelOpt NVFP4", "gpt-oss MXFP4", "compressed-tensors nvfp4"
        typ = s["type"].upper() if fmt in ("ModelOpt", "gpt-oss") else s["type"]
        head = f"{fmt} {typ}" + (f" {s['packing']}" if typ.startswith("int") or fmt == "torchao" else "")
    else:
        head = f"{fmt} {s['bits']}-bit" + (f" {s['version']}" if "version" in s else "")
    parts = [head]
    if s.get("strategy") and s["strategy"] != "group":
        parts.append(f"{s['strategy']} strategy")
    if "group_size" in s:
        parts.append("one group per row (group_size -1)" if s["group_size"] == -1 else f"group {s['group_size']}")
    if "block" in s:
        parts.append("block " + "x".join(map(str, s["block"])))
    if "rank" in s:  # SVDQuant's low-rank branch
        parts.append(f"rank {s['rank']}")
    if "axis" in s:
        parts.append(f"axis {s['axis']}")
    if "sym" in s:
        parts.append("sym" if s["sym"] else "asym")
    if s.get("act_order"):
        parts.append("act-order (g_idx)")
    if "zero_points" in s:
        parts.append(f"{s['zero_points']} zero points")
    if "activations" in s:  # a compressed-tensors scheme that quantizes activations too (FP8_DYNAMIC, W8A8 ...)
        parts.append(_activations_label(s["activations"]))
    return ", ".join(parts)


def _activations_label(a: dict) -> str:
    """"activations fp8 dynamic per token", "activations fp8 static per tensor", "... per group 128"."""
    when = {True: "dynamic", False: "static"}.get(a["dynamic"], f"dynamic ({a['dynamic']})")
    per = a["strategy"].replace("_", " ") + (f" {a['group_size']}" if "group_size" in a else "")
    return f"activations {a['type']} {when} per {per}"

