"""The reference pages, generated from the code: committed in
``docs/reference/`` so that they read as reference in the source tree, and
regenerated into the site when it builds, so the site cannot drift from the
code.

A generated region of a page runs from its opening marker to
``<!-- fusetrain:end KIND -->``:

- ``<!-- fusetrain:config-schema -->``: the trainer's every configuration
  key, from ``fusetrain train --print-schema`` (the schema in
  ``trainer/config.cpp``): key, type, default, accepted values, meaning.
- ``<!-- fusetrain:cpp-api -->``: the documented declarations of the public
  C++ headers (those ``csrc/fusetrain.h`` includes): each header's opening
  comment, then every ``///`` comment with the declaration it precedes.
- ``<!-- fusetrain:python-api`` + an ``automodule`` directive ``-->``: the
  module's public names (its ``:members:``, else its ``__all__``), each with
  its signature and docstring, from the installed package.

Run as a script (``make reference``), it rewrites the regions of the
committed pages from the current build; ``--check`` only says which are
stale (exit 1). tests/python/test_docs.py fails while a committed page
differs from what this generates. As a Sphinx extension it regenerates the
config and C++ regions at build time (``source-read``) and hands the Python
ones to autodoc (the ``automodule`` directive of the marker), so each page
has its content once.

The trainer binary is ``$FUSETRAIN_BUILD_DIR/fusetrain`` (default
``build/fusetrain``): both need ``make build`` first.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

try:
    from sphinx.errors import ExtensionError
except ImportError:  # run as a script, or by the tests, without Sphinx
    ExtensionError = RuntimeError

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "reference"
# The committed pages with generated regions.
GENERATED_PAGES = ("config.md", "cpp.md", "python.md")
REFRESH = "make reference"  # (python docs/_ext/fusetrain_docs.py)
_REGION = re.compile(r"(<!-- fusetrain:(config-schema|cpp-api|python-api)\b(.*?)-->\n)(.*?)"
                     r"(<!-- fusetrain:end \2 -->)", re.S)


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
            # (a declaration, not an example for test_docs to compile)
            out += ["<!-- docs-test: fragment -->", "```cpp", f"// {scope}" if scope else "// (global)",
                    decl, "```", "", _comment_markdown(comment), ""]
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------ Python API

_AUTOMODULE = re.compile(r"^\.\. automodule:: (\S+)[ \t]*\n((?:[ \t]+:[\w-]+:.*\n?)*)", re.M)
_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|attr|mod|data|exc|obj):`~?([^`]+)`")


def _docstring_markdown(doc: str) -> str:
    """A docstring (reST as the package writes it: ``code``, :func:`x`,
    "- " lists, ``::`` literal blocks) as Markdown."""
    def inline(text: str) -> str:
        text = _ROLE.sub(lambda m: "`" + (m.group(1).rsplit(".", 1)[-1] if "~" in m.group(0) else m.group(1))
                         + "`", text)
        return re.sub(r"``(.+?)``", r"`\1`", text, flags=re.S)  # (a span may wrap a line)

    lines = inspect.cleandoc(doc).splitlines()
    out, prose, i = [], [], 0
    while i < len(lines):
        line = lines[i]
        if not line.rstrip().endswith("::"):
            prose.append(line)
            i += 1
            continue
        head = line.rstrip()[:-2].rstrip()
        if head:
            prose.append(head + ":")
        indent = len(line) - len(line.lstrip())
        i += 1
        block = []
        while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent):
            block.append(lines[i])
            i += 1
        while block and not block[-1].strip():
            block.pop()
        out += [inline("\n".join(prose)), "", "```text", *inspect.cleandoc("\n".join(block)).splitlines(),
                "```", ""]
        prose = []
    out.append(inline("\n".join(prose)))
    return "\n".join(out).strip()


def _signature(obj) -> str:
    """``(a, b=1, *, c=None)``: the call as a reader writes it (annotations
    left out, as the site shows them in the description)."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return ""
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    if params and params[0].name in ("self", "cls"):
        params = params[1:]  # a method's, as it is called
    text = str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))
    text = re.sub(r"<class '([\w.]+)'>", r"\1", text)
    return re.sub(r"<([\w.]+) object at 0x[0-9a-f]+>", r"<\1>", text)  # no addresses: the page is stable


def _constant_comment(module, name: str) -> str:
    """The ``#:`` comment above a module constant's assignment (what autodoc shows)."""
    m = re.search(rf"((?:^#:.*\n)+){re.escape(name)}\s*[:=]", inspect.getsource(module), re.M)
    return " ".join(line[2:].strip() for line in m.group(1).splitlines()) if m else ""


def _own_doc(obj) -> str:
    return obj.__doc__ if isinstance(getattr(obj, "__doc__", None), str) else ""


def _class_markdown(qualname: str, cls, level: int) -> list:
    bases = [b for b in cls.__bases__ if b is not object]
    out = [f"{'#' * level} `{qualname}`", "", f"`class {qualname}{_signature(cls)}`", ""]
    if bases:
        out += ["Bases: " + ", ".join(f"`{b.__module__}.{b.__qualname__}`" for b in bases), ""]
    if _own_doc(cls):
        out += [_docstring_markdown(cls.__doc__), ""]
    if issubclass(cls, __import__("enum").Enum):
        out += ["Members: " + ", ".join(f"`{m.name}`" for m in cls), ""]
    for name, member in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        title = f"{qualname}.{name}"
        if isinstance(member, property) or type(member).__name__ == "cached_property":
            if _own_doc(member):
                out += [f"{'#' * (level + 1)} `{title}` (property)", "", _docstring_markdown(member.__doc__), ""]
        elif inspect.isclass(member):
            if _own_doc(member):
                out += _class_markdown(title, member, level + 1)
        elif inspect.isroutine(member) and _own_doc(member):
            out += [f"{'#' * (level + 1)} `{title}{_signature(member)}`", "", _docstring_markdown(member.__doc__), ""]
    return out


def reference_modules(text: str) -> list:
    """(module, members or None) of each ``automodule`` directive in a page."""
    out = []
    for m in _AUTOMODULE.finditer(text):
        listed = dict(re.findall(r":([\w-]+):[ \t]*(.*)", m.group(2))).get("members", "").strip()
        out.append((m.group(1), [n.strip() for n in listed.split(",") if n.strip()] if listed else None))
    return out


def render_python_module(directive: str) -> str:
    """The Markdown of one ``automodule`` directive: the module's docstring,
    then each of its public names (``:members:``, else ``__all__``) with its
    signature and docstring, a class's documented methods and properties under
    it. A module that does not import here (an optional library missing) is
    an error: the committed page documents it."""
    (modname, members), = reference_modules(directive.strip() + "\n")
    module = importlib.import_module(modname)
    out = [_docstring_markdown(module.__doc__ or ""), ""]
    for name in members if members is not None else getattr(module, "__all__", []):
        obj = getattr(module, name)
        qualname = f"{modname}.{name}"
        if inspect.ismodule(obj):
            continue  # documented under its own heading
        if inspect.isclass(obj):
            out += _class_markdown(qualname, obj, 3)
        elif callable(obj):
            out += [f"### `{qualname}{_signature(obj)}`", "", _docstring_markdown(_own_doc(obj)), ""]
        else:
            out += [f"### `{qualname}` = `{obj!r}`", "", _docstring_markdown(_constant_comment(module, name)), ""]
    return "\n".join(out)


# ------------------------------------------------------------------ the pages


def _render(kind: str, args: str) -> str:
    if kind == "config-schema":
        return render_config_schema()
    if kind == "cpp-api":
        return render_cpp_api()
    return render_python_module(args)


def regenerate(text: str) -> str:
    """The page with each generated region rendered afresh."""
    def fill(m):
        body = re.sub(r"\n{3,}", "\n\n", _render(m.group(2), m.group(3)).strip())
        return f"{m.group(1)}\n{body}\n\n{m.group(5)}"
    return _REGION.sub(fill, text)


def generated_pages() -> dict:
    """{committed page: what it should hold} for every page with generated regions."""
    return {REFERENCE / name: regenerate((REFERENCE / name).read_text()) for name in GENERATED_PAGES}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Regenerate docs/reference/*.md from the build "
                                     "(fusetrain train --print-schema), the C++ headers and the package's docstrings.")
    parser.add_argument("--check", action="store_true", help="only report the stale pages (exit 1 if any)")
    args = parser.parse_args(argv)
    stale = []
    for path, text in generated_pages().items():
        if path.read_text() != text:
            stale.append(path)
            if not args.check:
                path.write_text(text)
    verb = "stale" if args.check else "rewritten"
    for path in stale:
        print(f"{verb}: {path.relative_to(ROOT)}")
    if not stale:
        print("docs/reference/ is up to date")
    return 1 if stale and args.check else 0


def _source_read(app, docname: str, source: list) -> None:
    """The config and C++ regions rendered from the build and the headers as
    they are now (the committed text may be older); a Python region becomes
    its automodule directive, for autodoc. The markers go."""
    def build(m):
        if m.group(2) == "python-api":
            return "```{eval-rst}\n" + m.group(3).strip() + "\n```"
        # (the test-only markers of the committed page are no part of the site)
        return _render(m.group(2), m.group(3)).replace("<!-- docs-test: fragment -->\n", "")
    source[0] = _REGION.sub(build, source[0])


def setup(app) -> dict:
    app.connect("source-read", _source_read)
    # The generated pages depend on files outside docs/: rebuild them always.
    app.connect("env-get-outdated", lambda app, env, added, changed, removed:
                [d for d in ("reference/config", "reference/cpp") if d in env.found_docs])
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}


if __name__ == "__main__":
    sys.exit(main())
