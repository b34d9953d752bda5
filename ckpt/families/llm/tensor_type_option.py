"""llama-quantize's `--tensor-type PATTERN=TYPE`, read as its `parse_tensor_type` reads it (tools/quantize/quantize.cpp
of the llama.cpp the llama-cpp-python 0.3.36 sdist vendors), and the GGML type names its `parse_ggml_type` takes.

What llama-quantize does with the text: the first `=` splits it (none: "malformed tensor type"; nothing before it:
"missing tensor name"; nothing after it: "missing quantization type"); the pattern is lowercased (ASCII, C's
`tolower`: so `\\D` becomes `\\d`); the type is any `ggml_type_name` in any case ("q4_K", "Q8_0", "iq2_xxs"). The
library then compiles each pattern as a C++ `std::regex` (ECMAScript grammar, libstdc++) and gives a quantizable
tensor the type of the first pattern that `std::regex_search` finds in its GGUF name; a pattern that matches no
tensor changes nothing (llama.cpp says nothing; `ckpt.families.llm.quant_mix.unused_tensor_types` lists them).

Python's `re` is not ECMAScript, so the pattern is translated (`ecma_regex`): libstdc++'s identity escapes (`\\k` is
`k`, and so is its `\\ck`), `\\0`, POSIX classes (`[[:digit:]]`), the empty class `[]` and `[^]` mean there what they
mean in llama.cpp; what llama.cpp refuses (`blk{`, `(?i)`, lookbehind) is refused, and the few forms whose meaning
the two engines do not share and ckpt does not translate (possessive `*+`, stacked `a**`, `(?P`, `(?#`) are refused
too, each in one line. tests/test_gguf_mix_imatrix.py checks the translation against llama.cpp's own matching.

Pure Python (no torch, no gguf): the CLI checks the flag before any file is read.
"""

from __future__ import annotations

import re
import warnings

from ckpt.errors import CkptError

# ggml_quantize_chunk's cases: the types llama-quantize can give a tensor (ggml's own names, upper case)
QUANT_TARGETS = ("F32", "F16", "BF16", "Q1_0", "Q2_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4", "NVFP4",
                 "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "TQ1_0", "TQ2_0", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS",
                 "IQ3_S", "IQ1_S", "IQ1_M", "IQ4_NL", "IQ4_XS")
# type names ggml knows that ggml_quantize_chunk has no case for: llama-quantize takes them and then aborts
NOT_TARGETS = ("Q8_1", "Q8_K", "I8", "I16", "I32", "I64", "F64")

MAX_SHOWN = 40  # error lines show at most this much of the user's text


def _shown(text: str) -> str:
    return repr(text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN - 3] + "...")


def ggml_type(text: str, flag: str) -> str:
    """A GGML type named as llama-quantize's parse_ggml_type takes it (any case), as ggml's upper-case name; one
    line naming `flag` otherwise."""
    up = text.upper()
    if up in QUANT_TARGETS:
        return up
    if up in NOT_TARGETS:
        raise CkptError(f"{flag} {_shown(text)}: llama.cpp cannot quantize a tensor to {up} (choose "
                        f"{', '.join(QUANT_TARGETS)})")
    raise CkptError(f"{flag} {_shown(text)}: unknown GGML type (choose {', '.join(QUANT_TARGETS)})")


def parse_tensor_type(text: str) -> tuple[str, str]:
    """`--tensor-type PATTERN=TYPE` -> (the pattern as llama.cpp matches it: lowercased, GGML type name), refused in
    one line where llama-quantize refuses it (and where ckpt cannot read the pattern as llama.cpp does)."""
    flag = f"--tensor-type {_shown(text)}"
    pattern, eq, type_text = text.partition("=")
    if not eq:
        raise CkptError(f"{flag}: malformed, expected PATTERN=TYPE (e.g. attn_v=q8_0)")
    if not pattern:
        raise CkptError(f"{flag}: missing tensor name pattern before '='")
    if not type_text:
        raise CkptError(f"{flag}: missing quantization type after '='")
    pattern = pattern.translate(_ASCII_LOWER)
    t = ggml_type(type_text, "--tensor-type")
    compile_pattern(pattern, flag)
    return pattern, t


_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")
_COMPILED: dict[str, re.Pattern] = {}


def compile_pattern(pattern: str, flag: str | None = None) -> re.Pattern:
    """The pattern (as llama.cpp gets it) compiled to match as `std::regex_search` does; one line otherwise."""
    rx = _COMPILED.get(pattern)
    if rx is None:
        try:
            py = ecma_regex(pattern)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                rx = re.compile(py, re.ASCII)
        except (_Refused, re.error) as e:
            why = e.msg if isinstance(e, re.error) else str(e)
            raise CkptError(f"{flag or '--tensor-type ' + _shown(pattern)}: the pattern is not a regular "
                            f"expression llama-quantize can use ({why})") from None
        _COMPILED[pattern] = rx
    return rx


class _Refused(ValueError):
    pass


# libstdc++'s ECMAScript escapes with a meaning of their own, the same in Python's `re` (after lowercasing):
# classes, word boundary, control characters, hex \xhh and \uhhhh
_SAME_ESCAPES = "bdswfnrtvxu"
# `[[:name:]]` in libstdc++ (C locale), as ASCII ranges inside a Python class
POSIX_CLASSES = {
    "alnum": "0-9A-Za-z", "alpha": "A-Za-z", "blank": "\\t ", "cntrl": "\\x00-\\x1f\\x7f", "digit": "0-9",
    "graph": "!-~", "lower": "a-z", "print": " -~", "punct": "!-/:-@\\[-`{-~", "space": "\\t\\n\\v\\f\\r ",
    "upper": "A-Z", "xdigit": "0-9A-Fa-f", "d": "0-9", "s": "\\t\\n\\v\\f\\r ", "w": "0-9A-Za-z_",
}
_REPEAT = re.compile(r"\{(\d+)(,(\d*))?\}")


def _escape(p: str, i: int, in_class: bool) -> tuple[str, int]:
    """The escape at p[i] == '\\' as Python writes it, and the index after it."""
    if i + 1 >= len(p):
        raise _Refused("it ends in a lone backslash")
    e = p[i + 1]
    if e in _SAME_ESCAPES:
        if e == "b" and in_class:
            return "\\x08", i + 2  # backspace in a class, in both
        return "\\" + e, i + 2
    if e == "c":  # \cX: libstdc++ reads it as X itself (not ECMAScript's control character X % 32)
        if i + 2 < len(p):
            return re.escape(p[i + 2]), i + 3
        raise _Refused("it ends in \\c")
    if e == "0":
        return "\\x00", i + 2
    if e.isdigit():
        if in_class:
            raise _Refused("a back-reference inside [...]")
        return "\\" + e, i + 2  # a back-reference; Python checks the group exists, as libstdc++ does
    return re.escape(e), i + 2  # an identity escape: the character itself (libstdc++ takes \k as k)


def _class(p: str, i: int) -> tuple[str, int]:
    """The bracket expression at p[i] == '[' as Python writes it, and the index after it."""
    j = i + 1
    neg = j < len(p) and p[j] == "^"
    j += neg
    if j < len(p) and p[j] == "]":  # ECMAScript's [] never matches, [^] matches any character
        return ("[\\s\\S]" if neg else "(?!)"), j + 1
    out = ["[^" if neg else "["]
    while True:
        if j >= len(p):
            raise _Refused("a '[' without its ']'")
        c = p[j]
        if c == "]":
            return "".join(out) + "]", j + 1
        if c == "\\":
            s, j = _escape(p, j, True)
            out.append(s)
        elif c == "[" and j + 1 < len(p) and p[j + 1] in ":.=":
            end = p.find(p[j + 1] + "]", j + 2)
            if end < 0:
                raise _Refused(f"'[{p[j + 1]}' without its '{p[j + 1]}]'")
            name = p[j + 2:end]
            if p[j + 1] != ":" or name not in POSIX_CLASSES:
                raise _Refused(f"unknown class [{p[j + 1]}{name}{p[j + 1]}]")
            out.append(POSIX_CLASSES[name])
            j = end + 2
        elif c == "-":
            out.append("-")
            j += 1
        else:
            out.append(re.escape(c))
            j += 1


def ecma_regex(p: str) -> str:
    """A Python `re` pattern that matches what libstdc++'s ECMAScript `std::regex` of `p` matches (module
    docstring); _Refused where the two engines differ and this does not translate."""
    out: list[str] = []
    i = 0
    quantified = False  # the last token was a quantifier (another one right after it is refused)
    while i < len(p):
        c = p[i]
        if c == "\\":
            s, i = _escape(p, i, False)
            out.append(s)
            quantified = False
        elif c == "[":
            s, i = _class(p, i)
            out.append(s)
            quantified = False
        elif c == "(":
            if p.startswith("(?", i) and p[i + 2:i + 3] not in (":", "=", "!"):
                raise _Refused("only (?:...), (?=...) and (?!...) groups")
            out.append(c)
            i += 1
            quantified = False
        elif c in "*+?{":
            if c == "{":
                m = _REPEAT.match(p, i)
                if m is None:
                    raise _Refused("a '{' that is not a {n}, {n,} or {n,m} repeat (write \\{ for the character)")
                if m.group(3) and int(m.group(3)) < int(m.group(1)):
                    raise _Refused(f"the repeat {m.group(0)} counts down")
                token, i = m.group(0), m.end()
            else:
                token, i = c, i + 1
            if quantified:
                raise _Refused("a repeat right after a repeat (such as a** or a*+)")
            if i < len(p) and p[i] == "?":  # lazy: matches the same names
                token, i = token + "?", i + 1
            out.append(token)
            quantified = True
        elif c in "}]":
            out.append("\\" + c)  # a literal in both
            i += 1
            quantified = False
        else:
            out.append(c if c in "^$.|)" else re.escape(c))
            i += 1
            quantified = False
    return "".join(out)
