"""What the tokenizer files beside a Hugging Face LLM's weights must hold before a llama.cpp GGUF is made of
them: tokenizer.json, tokenizer_config.json, added_tokens.json, special_tokens_map.json, the chat template
files, merges.txt.

Why: the readers llama.cpp's converter uses (gguf's `SpecialVocab` and `LlamaHfVocab`, transformers'
`AutoTokenizer`) open these files themselves and take their shapes on trust: a tokenizer.json that is not
JSON is a JSONDecodeError, an `added_tokens_decoder` entry without `content` a KeyError, a negative token id
a ValueError, and a chat template that is not valid Jinja is written into a GGUF llama-cpp-python refuses
to load. So every file the readers will open is read here first, through `ckpt.io.small_inputs` (a regular
file of a bounded size, valid UTF-8 JSON), and its structure checked where those readers index into it; a
problem is one line naming the file. What is left to the libraries (a merge naming a token the vocabulary
lacks, say) is their own parse, whose error the exporter words in one line the same way.

The chat template is compiled as transformers compiles it (jinja2's sandboxed environment with
`trim_blocks`, `lstrip_blocks`, loop controls and the `{% generation %}` tag), the templates gguf's
SpecialVocab picks, in its order: tokenizer_config.json's `chat_template`, else chat_template.jinja (and
additional_chat_templates/*.jinja), else chat_template.json.
"""

from __future__ import annotations

from pathlib import Path

from ckpt.errors import CkptError
from ckpt.io.small_inputs import load_json_object, read_text

I32 = 2**31 - 1  # llama_token
MODEL_TYPES = ("BPE", "Unigram", "WordLevel", "WordPiece")  # the `tokenizers` library's models
SPECIAL_TYPES = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")  # SpecialVocab's special_token_types
JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "added_tokens.json", "special_tokens_map.json",
              "chat_template.json")


def _present(path: Path) -> bool:
    """There is something at `path` (a FIFO, a folder or a dangling link too: then read_small says what)."""
    return path.exists() or path.is_symlink()


def _show(v) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


def brief(text: str, limit: int = 100) -> str:
    """A library's message as part of one line: its lines joined, cut short."""
    one = " ".join(text.split())
    return one if len(one) <= limit else one[:limit - 3] + "..."


def _kind(v) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number"}.get(type(v), "null")


def _token_id(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= I32


def read_json(folder: Path, name: str) -> dict | None:
    """The JSON object in `folder/name`, None where there is no such file."""
    path = folder / name
    return load_json_object(path) if _present(path) else None


def check_folder(folder: Path) -> None:
    """Every tokenizer file in `folder` the converter's readers open, checked as the module docstring says."""
    data = {name: read_json(folder, name) for name in JSON_FILES}
    if data["tokenizer.json"] is not None:
        check_tokenizer_json(folder / "tokenizer.json", data["tokenizer.json"])
    config = data["tokenizer_config.json"]
    if config is not None:
        check_tokenizer_config(folder / "tokenizer_config.json", config)
    if (added := data["added_tokens.json"]) is not None:
        for k, v in added.items():
            if not _token_id(v):
                raise CkptError(f"{folder / 'added_tokens.json'}: token {_show(k)} has id {_show(v)}, not a token id "
                                "(an integer from 0 to 2^31 - 1)")
    if _present(folder / "merges.txt"):
        read_text(folder / "merges.txt")
    for label, name, template in chat_templates(folder, config, data["chat_template.json"]):
        check_template(label, name, template)


def _object(path: Path, where: str, v, keys_of: str = "") -> dict:
    if not isinstance(v, dict):
        raise CkptError(f"{path}: {where} is {_kind(v)}, not an object{keys_of}")
    return v


def _typed(path: Path, where: str, v) -> None:
    """A tokenizers component (normalizer, pre-tokenizer, post-processor, decoder): null or an object with a
    string `type`, and its sequence members likewise."""
    if v is None:
        return
    _object(path, where, v)
    if not isinstance(v.get("type"), str):
        raise CkptError(f"{path}: {where} has type {_show(v.get('type'))}, not a component name")
    for key in ("processors", "normalizers", "pretokenizers", "decoders"):
        if key in v:
            members = v[key]
            if not isinstance(members, list):
                raise CkptError(f"{path}: {where}.{key} is {_kind(members)}, not a list")
            for i, m in enumerate(members):
                _typed(path, f"{where}.{key}[{i}]", m)
    for key in ("single", "pair"):  # TemplateProcessing: SpecialVocab reads each piece's SpecialToken / Sequence
        if key in v:
            pieces = v[key]
            if not isinstance(pieces, list):
                raise CkptError(f"{path}: {where}.{key} is {_kind(pieces)}, not a list")
            for i, p in enumerate(pieces):
                _object(path, f"{where}.{key}[{i}]", p)
                for part in ("SpecialToken", "Sequence"):
                    if part in p:
                        _object(path, f"{where}.{key}[{i}].{part}", p[part])
    for key in ("cls", "sep"):  # RobertaProcessing: [token, id]
        if key in v and not isinstance(v[key], list):
            raise CkptError(f"{path}: {where}.{key} is {_kind(v[key])}, not a [token, id] list")


def check_tokenizer_json(path: Path, tok: dict) -> None:
    """tokenizer.json as the `tokenizers` library writes it: a model of a known type with its vocabulary
    (token -> id, or Unigram's [token, score] list) and merges, added tokens with ids, typed components."""
    model = tok.get("model")
    if not isinstance(model, dict):
        raise CkptError(f"{path}: has no tokenizer model (its 'model' is {_kind(model)}, not an object)")
    kind = model.get("type")
    if kind not in MODEL_TYPES:
        raise CkptError(f"{path}: model type {_show(kind)} is none of {', '.join(MODEL_TYPES)}")
    vocab = model.get("vocab")
    if kind == "Unigram":
        if not isinstance(vocab, list):
            raise CkptError(f"{path}: the Unigram vocabulary is {_kind(vocab)}, not a list of [token, score] pairs")
        for i, entry in enumerate(vocab):
            if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)
                    and isinstance(entry[1], (int, float)) and not isinstance(entry[1], bool)):
                raise CkptError(f"{path}: Unigram vocabulary entry {i} is {_show(entry)}, not a [token, score] pair")
    else:
        if not isinstance(vocab, dict):
            raise CkptError(f"{path}: the {kind} vocabulary is {_kind(vocab)}, not an object of token -> id")
        for t, i in vocab.items():
            if not _token_id(i):
                raise CkptError(f"{path}: token {_show(t)} has id {_show(i)}, not a token id (an integer from 0 to "
                                "2^31 - 1)")
    if kind == "BPE":
        merges = model.get("merges", [])
        if not isinstance(merges, list):
            raise CkptError(f"{path}: the BPE merges are {_kind(merges)}, not a list")
        pairs = bool(merges) and isinstance(merges[0], list)
        for i, m in enumerate(merges):
            ok = (isinstance(m, list) and len(m) == 2 and all(isinstance(x, str) for x in m)) if pairs else \
                (isinstance(m, str) and len(m.split(" ")) == 2)
            if not ok:
                form = "a [token, token] pair (the form of merge 0)" if pairs else "two tokens split by one space"
                raise CkptError(f"{path}: merge {i} is {_show(m)}, not {form}")
    added = tok.get("added_tokens", [])
    if not isinstance(added, list):
        raise CkptError(f"{path}: added_tokens is {_kind(added)}, not a list")
    for i, a in enumerate(added):
        _object(path, f"added_tokens[{i}]", a)
        if not _token_id(a.get("id")):
            raise CkptError(f"{path}: added_tokens[{i}] has id {_show(a.get('id'))}, not a token id (an integer from "
                            "0 to 2^31 - 1)")
        if not isinstance(a.get("content"), str):
            has = f"content {_show(a['content'])}, not a string" if "content" in a else "no content"
            raise CkptError(f"{path}: added_tokens[{i}] has {has}")
    for key in ("normalizer", "pre_tokenizer", "post_processor", "decoder"):
        _typed(path, key, tok.get(key))


def check_tokenizer_config(path: Path, cfg: dict) -> None:
    """tokenizer_config.json where the readers index into it: `added_tokens_decoder` (id -> {content, special}),
    the special tokens (a string or {content}), the add-token flags, add_prefix_space, model_max_length,
    tokenizer_class."""
    decoder = cfg.get("added_tokens_decoder")
    if decoder is not None:
        _object(path, "added_tokens_decoder", decoder, " of token id -> token")
        for k, d in decoder.items():
            if not (k.isdecimal() and int(k) <= I32):
                raise CkptError(f"{path}: added_tokens_decoder has key {_show(k)}, not a token id (an integer from 0 "
                                "to 2^31 - 1)")
            _object(path, f"added_tokens_decoder[{k!r}]", d)
            if not isinstance(d.get("content"), str):
                has = f"content {_show(d['content'])}, not a string" if "content" in d else "no content"
                raise CkptError(f"{path}: added_tokens_decoder[{k!r}] has {has}")
            if not isinstance(d.get("special", False), bool):
                raise CkptError(f"{path}: added_tokens_decoder[{k!r}] has special {_show(d.get('special'))}, not "
                                "true or false")
    for typ in SPECIAL_TYPES:
        v = cfg.get(f"{typ}_token")
        if v is not None and not isinstance(v, str) and not (isinstance(v, dict) and isinstance(v.get("content"), str)):
            raise CkptError(f"{path}: {typ}_token is {_show(v)}, not a token (a string or an object with content)")
        flag = cfg.get(f"add_{typ}_token")
        if flag is not None and not isinstance(flag, bool):
            raise CkptError(f"{path}: add_{typ}_token is {_show(flag)}, not true or false")
    if cfg.get("add_prefix_space") is not None and not isinstance(cfg["add_prefix_space"], bool):
        raise CkptError(f"{path}: add_prefix_space is {_show(cfg['add_prefix_space'])}, not true or false")
    length = cfg.get("model_max_length")
    if length is not None and (isinstance(length, bool) or not isinstance(length, (int, float))):
        raise CkptError(f"{path}: model_max_length is {_show(length)}, not a number")
    if cfg.get("tokenizer_class") is not None and not isinstance(cfg["tokenizer_class"], str):
        raise CkptError(f"{path}: tokenizer_class is {_show(cfg['tokenizer_class'])}, not a class name")


def _template_list(path: Path, key: str, v) -> list[tuple[str, str, str]]:
    """A chat_template value: a string, or a list of {name, template} (the named templates); as (label, name,
    template) triples."""
    if isinstance(v, str):
        return [(str(path), "", v)]
    if isinstance(v, list):
        out = []
        for i, t in enumerate(v):
            if not (isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)):
                raise CkptError(f"{path}: {key}[{i}] is {_show(t)}, not a {{name, template}} object")
            out.append((str(path), t["name"], t["template"]))
        return out
    raise CkptError(f"{path}: {key} is {_kind(v)}, not a template (a string or a list of named templates)")


def chat_templates(folder: Path, config: dict | None, template_json: dict | None) -> list[tuple[str, str, str]]:
    """The chat templates gguf's SpecialVocab writes into the GGUF, as (file, name, template): none without a
    tokenizer_config.json, else its `chat_template`, else chat_template.jinja (with the named templates of
    additional_chat_templates/), else chat_template.json's."""
    if config is None:
        return []
    if "chat_template" in config:
        return [] if config["chat_template"] is None else \
            _template_list(folder / "tokenizer_config.json", "chat_template", config["chat_template"])
    jinja = folder / "chat_template.jinja"
    if _present(jinja):
        out = [(str(jinja), "", read_text(jinja))]
        extra = folder / "additional_chat_templates"
        if extra.is_dir():
            out += [(str(p), p.stem, read_text(p)) for p in sorted(extra.glob("*.jinja"))]
        return out
    if template_json is not None and template_json.get("chat_template") is not None:
        return _template_list(folder / "chat_template.json", "chat_template", template_json["chat_template"])
    return []


def check_template(label: str, name: str, template: str) -> None:
    """Compile a chat template as transformers does (`apply_chat_template`); llama-cpp-python compiles it with
    jinja2 when it loads the GGUF, and refuses the file where it does not compile."""
    try:
        import jinja2
        from jinja2 import nodes
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:  # jinja2 comes with the gguf extra (and transformers' chat templates need it); without
        return  # it the template is written unchecked, as llama.cpp's converter writes it

    class Generation(Extension):
        """transformers' `{% generation %}...{% endgeneration %}` (its AssistantTracker), parsed as a scope."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    try:
        env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        what = f"chat template {name!r}" if name else "the chat template"
        why = brief(str(e.message or e))
        raise CkptError(f"{label}: {what} is not valid Jinja ({why} at line {e.lineno})") from None
    except (jinja2.TemplateError, RecursionError, MemoryError) as e:
        what = f"chat template {name!r}" if name else "the chat template"
        raise CkptError(f"{label}: {what} does not compile ({type(e).__name__})") from None


__all__ = ["brief", "check_folder", "check_template", "check_tokenizer_config", "check_tokenizer_json",
           "chat_templates", "read_json"]
