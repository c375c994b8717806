"""Reference pages generated from the code at build time, so they cannot
drift from it:

- ``<!-- fusetrain:config-schema -->`` in a page becomes the trainer's every
  configuration key, from ``fusetrain train --print-schema`` (the schema in
  ``trainer/config.cpp``): key, type, default, accepted values, meaning.
- ``<!-- fusetrain:cpp-api -->`` becomes the documented declarations of the
  public C++ headers (those ``csrc/fusetrain.h`` includes): each header's
  opening comment, then every ``///`` comment with the declaration it
  precedes.

Both are plain Markdown handed to MyST through Sphinx's ``source-read``
event. The trainer binary is ``$FUSETRAIN_BUILD_DIR/fusetrain`` (default
``build/fusetrain``): the docs build needs ``make build`` first.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

from sphinx.application import Sphinx
from sphinx.errors import ExtensionError

ROOT = Path(__file__).resolve().parents[2]
CONFIG_MARKER = "<!-- fusetrain:config-schema -->"
CPP_MARKER = "<!-- fusetrain:cpp-api -->"


def _escape(text: str) -> str:
    """Markdown text that reads as written: no emphasis, links, HTML or
    table breaks from a help text or a comment (code spans are kept)."""
    parts = re.split(r"(`[^`]*`)", text)
    out = []
    for i, part in enumerate(parts):
        if i % 2:  # a code span
            out.append(part)
        else:
            out.append(re.sub(r"([\\*_\[\]<>|{}#])", r"\\\1", part))
    return "".join(out)


def _cell(text: str) -> str:
    return _escape(text).replace("|", "\\|")


def _code(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else f'"{value}"'
    return f"`{text}`"


def trainer_binary() -> Path:
    return Path(os.environ.get("FUSETRAIN_BUILD_DIR", ROOT / "build")) / "fusetrain"


def config_schema() -> dict:
    binary = trainer_binary()
    if not binary.exists():
        raise ExtensionError(f"{binary} does not exist: run `make build` before `make docs` "
                             "(the config reference comes from `fusetrain train --print-schema`)")
    out = subprocess.run([str(binary), "train", "--print-schema"], capture_output=True, text=True,
                         timeout=120, check=False)
    if out.returncode != 0:
        raise ExtensionError(f"{binary} train --print-schema: exit {out.returncode}\n{out.stderr}")
    return json.loads(out.stdout)


def _number(v) -> str:
    """16777216, 10^15, 1e-12, 0.999999: a bound exactly, as a reader writes it."""
    if float(v).is_integer():
        n = int(v)
        digits = str(abs(n))
        if abs(n) >= 10**7 and digits.strip("0") == "1":
            return f"{'-' if n < 0 else ''}10^{len(digits) - 1}"
        return str(n)
    return repr(float(v))


def render_config_schema() -> str:
    lines = []
    section = None
    for k in config_schema()["keys"]:
        if k["section"] != section:
            section = k["section"]
            lines += ["", f"## `{section}`", "", "| key | type | default | accepted | meaning |",
                      "| --- | --- | --- | --- | --- |"]
        if k["choices"]:
            accepted = ", ".join(f"`{c}`" for c in k["choices"])
        elif k["min"] is not None and k["max"] is not None:
            accepted = f"{_number(k['min'])} to {_number(k['max'])}"
        elif k["min"] is not None:
            accepted = f">= {_number(k['min'])}"
        elif k["max"] is not None:
            accepted = f"<= {_number(k['max'])}"
        else:
            accepted = ""
        default = k["default"]
        shown = "`\"\"`" if default == "" else _code(default)
        lines.append(f"| `{k['key']}` | {k['type']} | {shown} | {accepted} | {_cell(k['help'])} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ C++ headers


def public_headers() -> list:
    umbrella = ROOT / "csrc" / "fusetrain.h"
    names = re.findall(r"#include <fusetrain/([^>]+)>", umbrella.read_text())
    return [ROOT / "csrc" / n for n in names]


def _opening_comment(lines: list) -> str:
    text = []
    for line in lines:
        s = line.strip()
        if not s.startswith("//"):
            break
        text.append(s[2:].strip())
    return " ".join(t for t in text if t)


def _comment_markdown(comment: list) -> str:
    """A `///` block as Markdown: paragraphs, with lines indented by two or
    more spaces (code in a comment) kept as a literal block."""
    out, code = [], []

    def flush_code():
        if code:
            out.extend(["", "```text", *code, "```", ""])
            code.clear()

    for raw in comment:
        if raw.startswith("  ") and raw.strip():
            code.append(raw[2:])
            continue
        flush_code()
        out.append(_escape(raw.strip()) if raw.strip() else "")
    flush_code()
    return "\n".join(out)


def _declaration(lines: list, start: int) -> str:
    decl = []
    for line in lines[start:]:
        s = line.strip()
        if not s or s.startswith("//"):
            break
        cut = s.find("{")
        if cut >= 0 and not s.startswith("TORCH_ARG"):
            decl.append(s[:cut].rstrip())
            break
        decl.append(s)
        if s.endswith(";") or s.endswith(")") and s.startswith("#define"):
            break
    text = " ".join(d for d in decl if d)
    return re.sub(r"\s+", " ", text).rstrip(";").strip()


_NAMESPACE = re.compile(r"^namespace ([\w:]+) \{")
_CLASS = re.compile(r"^(?:template <.*> )?(?:class|struct) (\w+)[^;]*\{")


def header_entries(path: Path) -> list:
    """(scope, declaration, comment lines) for every `///` block of a
    header. The scope is the namespace, and the class for a member: the
    headers keep namespaces unindented and class members indented (the
    .clang-format), which is all this reads."""
    lines = path.read_text().splitlines()
    entries, i = [], 0
    namespaces, cls = [], ""
    while i < len(lines):
        line, s = lines[i], lines[i].strip()
        if _NAMESPACE.match(line):
            namespaces.append(_NAMESPACE.match(line).group(1))
        elif line.startswith("}  // namespace") and namespaces:
            namespaces.pop()
        elif _CLASS.match(line):
            cls = _CLASS.match(line).group(1)
        elif line.startswith("};"):
            cls = ""
        if s.startswith("///") and not s.startswith("///<"):
            comment = []
            while i < len(lines) and lines[i].strip().startswith("///"):
                body = lines[i].strip()[3:]
                comment.append(body[1:] if body.startswith(" ") else body)
                i += 1
            decl = _declaration(lines, i)
            member = i < len(lines) and lines[i].startswith(" ") and cls
            scope = "::".join(x for x in (*namespaces, cls if member else "") if x)
            if decl:
                entries.append((scope, decl, comment))
            continue
        i += 1
    return entries


def render_cpp_api() -> str:
    out = []
    for path in public_headers():
        rel = path.relative_to(ROOT / "csrc")
        lines = path.read_text().splitlines()
        out += ["", f"## `<fusetrain/{rel}>`", "", _escape(_opening_comment(lines)), ""]
        for scope, decl, comment in header_entries(path):
            out += ["```cpp", f"// {scope}" if scope else "// (global)", decl, "```", "",
                    _comment_markdown(comment), ""]
    return "\n".join(out) + "\n"


def _source_read(app: Sphinx, docname: str, source: list) -> None:
    text = source[0]
    if CONFIG_MARKER in text:
        text = text.replace(CONFIG_MARKER, render_config_schema())
    if CPP_MARKER in text:
        text = text.replace(CPP_MARKER, render_cpp_api())
    source[0] = text


def setup(app: Sphinx) -> dict:
    app.connect("source-read", _source_read)
    # The generated pages depend on files outside docs/: rebuild them always.
    app.connect("env-get-outdated", lambda app, env, added, changed, removed:
                [d for d in ("reference/config", "reference/cpp") if d in env.found_docs])
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
