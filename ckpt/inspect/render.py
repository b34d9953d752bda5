"""Terminal text for an inspect report: one block per component, warnings last so they are seen.

Long metadata values (kohya `ss_tag_frequency`, base64 thumbnails) are cut to one line; `--json` has
them whole.
"""

from __future__ import annotations

META_KEYS_SHOWN = 12
META_VALUE_CHARS = 80
UNQUANTIZED_SHOWN = 4  # plain matrices of a quantized model named in text (--json lists all)


def human_count(n: int) -> str:
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def human_bytes(n: int) -> str:
    for div, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


from ckpt.report import plural  # noqa: E402,F401  (one wording of counts everywhere)


def column(n: int, word: str) -> str:
    """A count for a table column: number right-aligned, word left-aligned."""
    return f"{n:>7,} {word + ('' if n == 1 else 's'):<{len(word) + 1}}"


def _short(v: str) -> str:
    v = " ".join(str(v).split())
    return v if len(v) <= META_VALUE_CHARS else v[: META_VALUE_CHARS - 3] + "..."


def render_text(report: dict, quiet: bool = False) -> str:
    """The report as text; `quiet` leaves out the notes (warnings stay), as --quiet does everywhere."""
    lines = [f"{report['source']}  ({report['kind']}{', ' + report['pipeline'] if report['pipeline'] else ''}"
             f"{', training checkpoint' if report['training_checkpoint'] else ''})"]
    for c in report["components"]:
        lines.append("")
        files = ", ".join(c["files"][:3]) + (f", ... ({len(c['files'])} files)" if len(c["files"]) > 3 else "")
        head = f"[{c['name']}] {files}" + (f"  (index {c['index']})" if c["index"] else "")
        lines.append(head)
        row = lambda k, v: lines.append(f"  {k:<11} {v}")  # noqa: E731
        row("format", f"{c['container']}, {c['kind']}")
        row("family", (c["family"] or "unknown") + (f"  [config: {c['config_class']}]" if c["config_class"] else ""))
        row("storage", ", ".join(c["encodings"]))
        q = c["quantization"]
        if q:
            for i, layer in enumerate(q["layers"]):
                row("quantized" if i == 0 else "", f"{column(layer['tensors'], 'tensor')}  {layer['label']}")
            plain, mats = q["unquantized"]["tensors"], q["unquantized"]["matrices"]
            shown = ", ".join(mats[:UNQUANTIZED_SHOWN]) + (", ..." if len(mats) > UNQUANTIZED_SHOWN else "")
            what = f"{len(mats)} matri{'x' if len(mats) == 1 else 'ces'}: {shown}" if mats else "no matrices"
            row("unquantized", f"{column(plain, 'tensor')}  {what}")
        if c["lora"]:
            lo = c["lora"]
            ranks = ", ".join(map(str, lo["ranks"])) or "?"
            row("lora", f"{', '.join(lo['types'])}; {plural(lo['modules'], 'module')}, rank {ranks}, "
                f"{plural(lo['alpha_keys'], 'alpha key')}")
            trained = [f"{k}={lo[k]}" for k in ("base_model", "network_module") if lo[k]]
            if trained:
                row("", "metadata: " + ", ".join(trained))
            if lo["adapter_config"]:
                row("", "adapter_config.json: " + ", ".join(f"{k}={v}" for k, v in lo["adapter_config"].items()))
        row("tensors", f"{c['tensors']:,}   parameters {human_count(c['parameters'])}   size {human_bytes(c['bytes'])}")
        for i, (name, d) in enumerate(sorted(c["dtypes"].items(), key=lambda kv: -kv[1]["bytes"])):
            row("dtypes" if i == 0 else "",
                f"{name:<12} {column(d['tensors'], 'tensor')}  {human_count(d['parameters']):>8} params  "
                f"{human_bytes(d['bytes']):>10}")
        prefixed = [p for p in c["parts"] if p["prefix"]]
        if prefixed or len(c["parts"]) > 1:
            width = max(len(p["prefix"] or "(none)") for p in c["parts"])
            unit = "module" if c["kind"] == "lora" else "tensor"
            for i, p in enumerate(c["parts"]):
                row("prefixes" if i == 0 else "", f"{p['prefix'] or '(none)':<{width}}  "
                    f"{column(p['tensors'], unit)}  {p['family'] or '?'}" + (f"  [{p['role']}]" if p["role"] else ""))
        if c["metadata"]:
            keys = sorted(c["metadata"])
            for i, k in enumerate(keys[:META_KEYS_SHOWN]):
                row("metadata" if i == 0 else "", f"{k} = {_short(c['metadata'][k])}")
            if len(keys) > META_KEYS_SHOWN:
                row("", f"... {len(keys) - META_KEYS_SHOWN} more (--json shows all)")
        if c["scan"] is not None:
            s = c["scan"]
            row("scan", f"{plural(s['tensors'], 'floating tensor')} read: {sum(s['nan'].values())} NaN, "
                f"{sum(s['inf'].values())} Inf")
        for n in ([] if quiet else c["notes"]):
            lines.append(f"  note: {n}")
    if len(report["components"]) > 1:
        t = report["totals"]
        lines += ["", f"total: {plural(len(report['components']), 'component')}, {plural(t['tensors'], 'tensor')}, "
                      f"parameters {human_count(t['parameters'])}, size {human_bytes(t['bytes'])}"]
    if report["notes"] and not quiet:
        lines.append("")
        lines += [f"note: {n}" for n in report["notes"]]
    if report["warnings"]:
        lines.append("")
        lines += [f"warning: {w}" for w in report["warnings"]]
    return "\n".join(lines)
