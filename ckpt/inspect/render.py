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
    lines = [_title(report)]
    for c in report["components"]:
        lines += ["", _component_head(c)]
        lines += [f"  {label:<11} {text}" for label, text in _component_rows(c)]
        lines += [] if quiet else [f"  note: {n}" for n in c["notes"]]
    for block in REPORT_BLOCKS:
        lines += block(report, quiet)
    return "\n".join(lines)


def _title(report: dict) -> str:
    """SRC and what it is: "x  (pipeline, StableDiffusionPipeline, training checkpoint)"."""
    pipeline = f", {report['pipeline']}" if report["pipeline"] else ""
    training = ", training checkpoint" if report["training_checkpoint"] else ""
    return f"{report['source']}  ({report['kind']}{pipeline}{training})"


def _component_head(c: dict) -> str:
    """"[name] first files, ... (N files)  (index X)": a sharded model names three files and counts them all."""
    files = ", ".join(c["files"][:3]) + (f", ... ({len(c['files'])} files)" if len(c["files"]) > 3 else "")
    return f"[{c['name']}] {files}" + (f"  (index {c['index']})" if c["index"] else "")


def _labelled(label: str, texts: list[str]) -> list[tuple[str, str]]:
    """Rows of one field: the label on the first, blank under it (the continuation rows of a table)."""
    return [(label if i == 0 else "", text) for i, text in enumerate(texts)]


def _first_few(names: list[str], show: int) -> str:
    """The first `show` names, then ", ..." when there are more: text stays one line, --json lists all."""
    return ", ".join(names[:show]) + (", ..." if len(names) > show else "")


def _basic_rows(c: dict) -> list[tuple[str, str]]:
    """What every component shows: its container and kind, its family, how its weights are stored."""
    config = f"  [config: {c['config_class']}]" if c["config_class"] else ""
    return [("format", f"{c['container']}, {c['kind']}"), ("family", (c["family"] or "unknown") + config),
            ("storage", ", ".join(c["encodings"]))]


def _quantization_rows(c: dict) -> list[tuple[str, str]]:
    """A quantized LLM: one row per setting combination, then the tensors left plain (their matrices are what
    a loader must expect in full precision)."""
    q = c["quantization"]
    if not q:
        return []
    layers = _labelled("quantized", [f"{column(x['tensors'], 'tensor')}  {x['label']}" for x in q["layers"]])
    plain, mats = q["unquantized"]["tensors"], q["unquantized"]["matrices"]
    what = f"{len(mats)} matri{'x' if len(mats) == 1 else 'ces'}: {_first_few(mats, UNQUANTIZED_SHOWN)}" \
        if mats else "no matrices"
    return layers + [("unquantized", f"{column(plain, 'tensor')}  {what}")]


def _lora_rows(c: dict) -> list[tuple[str, str]]:
    """A LoRA: its types, modules, ranks and alphas, then what its trainer wrote about it, when it did."""
    lo = c["lora"]
    if not lo:
        return []
    ranks = ", ".join(map(str, lo["ranks"])) or "?"
    rows = [("lora", f"{', '.join(lo['types'])}; {plural(lo['modules'], 'module')}, rank {ranks}, "
                     f"{plural(lo['alpha_keys'], 'alpha key')}")]
    trained = [f"{k}={lo[k]}" for k in ("base_model", "network_module") if lo[k]]
    if trained:
        rows.append(("", "metadata: " + ", ".join(trained)))
    if lo["adapter_config"]:
        rows.append(("", "adapter_config.json: " + ", ".join(f"{k}={v}" for k, v in lo["adapter_config"].items())))
    return rows


def _size_rows(c: dict) -> list[tuple[str, str]]:
    """Counts and sizes: the totals, then one row per stored dtype, largest first."""
    dtypes = sorted(c["dtypes"].items(), key=lambda kv: -kv[1]["bytes"])
    total = f"{c['tensors']:,}   parameters {human_count(c['parameters'])}   size {human_bytes(c['bytes'])}"
    return [("tensors", total)] + _labelled("dtypes", [
        f"{name:<12} {column(d['tensors'], 'tensor')}  {human_count(d['parameters']):>8} params  "
        f"{human_bytes(d['bytes']):>10}" for name, d in dtypes])


def _prefix_rows(c: dict) -> list[tuple[str, str]]:
    """Key prefixes, when there is one or several parts: what a loader expecting bare keys trips on."""
    parts = c["parts"]
    if not any(p["prefix"] for p in parts) and len(parts) <= 1:
        return []
    width = max(len(p["prefix"] or "(none)") for p in parts)
    unit = "module" if c["kind"] == "lora" else "tensor"
    return _labelled("prefixes", [f"{p['prefix'] or '(none)':<{width}}  {column(p['tensors'], unit)}  "
                                  f"{p['family'] or '?'}" + (f"  [{p['role']}]" if p["role"] else "") for p in parts])


def _metadata_rows(c: dict) -> list[tuple[str, str]]:
    """The first metadata keys, sorted, their values cut to one line; --json has them all."""
    keys = sorted(c["metadata"])
    rows = _labelled("metadata", [f"{k} = {_short(c['metadata'][k])}" for k in keys[:META_KEYS_SHOWN]])
    if len(keys) > META_KEYS_SHOWN:
        rows.append(("", f"... {len(keys) - META_KEYS_SHOWN} more (--json shows all)"))
    return rows


def _scan_rows(c: dict) -> list[tuple[str, str]]:
    """--scan's totals (the warnings name the tensors)."""
    s = c["scan"]
    if s is None:
        return []
    return [("scan", f"{plural(s['tensors'], 'floating tensor')} read: {sum(s['nan'].values())} NaN, "
                     f"{sum(s['inf'].values())} Inf")]


# A component's fields, in print order: each component -> its (label, text) rows.
COMPONENT_SECTIONS = (_basic_rows, _quantization_rows, _lora_rows, _size_rows, _prefix_rows, _metadata_rows,
                      _scan_rows)


def _component_rows(c: dict) -> list[tuple[str, str]]:
    """Every (label, text) row of a component, section by section in `COMPONENT_SECTIONS` order."""
    return [row for section in COMPONENT_SECTIONS for row in section(c)]


def _totals_block(report: dict, quiet: bool) -> list[str]:
    """Totals, only when there are several components (one component's own rows say it all)."""
    if len(report["components"]) <= 1:
        return []
    t = report["totals"]
    return ["", f"total: {plural(len(report['components']), 'component')}, {plural(t['tensors'], 'tensor')}, "
                f"parameters {human_count(t['parameters'])}, size {human_bytes(t['bytes'])}"]


def _notes_block(report: dict, quiet: bool) -> list[str]:
    """The report's own notes; --quiet leaves them out."""
    if not report["notes"] or quiet:
        return []
    return [""] + [f"note: {n}" for n in report["notes"]]


def _warnings_block(report: dict, quiet: bool) -> list[str]:
    """Warnings last, so that they are what the user sees; --quiet keeps them."""
    if not report["warnings"]:
        return []
    return [""] + [f"warning: {w}" for w in report["warnings"]]


# What follows the components, in print order: each (report, quiet) -> its lines.
REPORT_BLOCKS = (_totals_block, _notes_block, _warnings_block)
