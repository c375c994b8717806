"""The documentation's examples run, and the site builds.

- Every ``python`` block of ``docs/*.md`` and ``README.md`` runs: the blocks
  of a page in order, in one fresh interpreter (a page may build on its
  earlier blocks), in a temporary directory, as rank 0 of a world of one.
  ``<!-- docs-test: needs cuda -->`` (or ``needs tpu``) on the line before a
  block runs it only where that device is present: the CUDA ones in ``make
  gpu-check`` (``pytest -m cuda``), after the page's other blocks.
- ``sh`` blocks marked ``<!-- docs-test: run -->`` run from the repository
  root (``build/fusetrain`` is the build under test); those marked
  ``<!-- docs-test: run after python -->`` run in a temporary directory
  after the page's python blocks above them ran there (the files a reader
  writes first, then the commands as the page shows them).
- ``cpp`` blocks compile (in one file, each inside a function that sees the
  names of ``_CPP_PRELUDE``), or are excerpts of a tested program
  (``<!-- docs-test: excerpt FILE -->``: the block's lines appear in FILE,
  ``// ...`` standing for lines left out), or say they are not compiled
  (``<!-- docs-test: fragment -->``).
- ``make docs``'s Sphinx build passes with warnings as errors, so a broken
  reference, link or docstring fails here.
- Every public name the Python reference (``docs/reference/python.md``)
  documents has a docstring that names each of its arguments.
- The committed reference pages (``docs/reference/*.md``) are what ``make
  reference`` generates from the build, the headers and the docstrings.

The convention is documented in docs/architecture.md ("Documentation").
"""

from __future__ import annotations

import enum
import functools
import importlib
import importlib.util
import inspect
import json
import os
import re
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
BUILD = Path(os.environ.get("FUSETRAIN_BUILD_DIR", ROOT / "build"))
PAGES = sorted(DOCS.rglob("*.md")) + [ROOT / "README.md"]
MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([^\s`]*)")
KNOWN_DEVICES = ("cuda", "tpu")
_SHELL_MARKERS = ("run", "run after python")


@dataclass
class Block:
    page: Path
    line: int  # of the first code line, 1-based
    lang: str
    code: str
    marker: Optional[str]

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def code_blocks(page: Path) -> List[Block]:
    """The fenced code blocks of a Markdown page, each with the docs-test
    marker on the last non-blank line before it (None without one)."""
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = len(m.group(1)), m.group(2), m.group(3)
        j = i - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        marker = MARKER.match(lines[j]).group(1) if j >= 0 and MARKER.match(lines[j]) else None
        body, k = [], i + 1
        while k < len(lines) and not lines[k].strip().startswith(fence):
            body.append(lines[k][indent:] if lines[k][:indent].strip() == "" else lines[k])
            k += 1
        blocks.append(Block(page, i + 2, lang, "\n".join(body) + "\n", marker))
        i = k + 1
    return blocks


ALL_BLOCKS = [b for page in PAGES for b in code_blocks(page)]
PYTHON_PAGES = sorted({b.page for b in ALL_BLOCKS if b.lang == "python"})


def _device_present(device: str) -> bool:
    import torch

    if device == "cuda":
        return torch.cuda.is_available()
    import fusetrain

    return fusetrain.tpu_available()


_PATH = re.compile(r"`((?:csrc|python|trainer|tests|bench|scripts|configs|examples|docs|cmake)/[^`\s]*)`")


def test_paths_named_in_the_docs_exist():
    """A file or folder a page names in backticks (`csrc/ops/generic.cpp`,
    `tests/cuda_emulator/`) is there: the pages follow the source layout."""
    missing = []
    for page in PAGES:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            for path in _PATH.findall(line):
                path = path.rstrip(".,:;)")
                if any(c in path for c in "<>{}$") or "..." in path or "NAME" in path:
                    continue  # a pattern or placeholder (csrc/kernels/NAME.cu), not a path
                if not (list(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()):
                    missing.append(f"{page.relative_to(ROOT)}:{n}: {path}")
    # Links of the READMEs, which Sphinx does not check (docs/ links it does).
    for page in (ROOT / "README.md", ROOT / "trainer" / "README.md"):
        for n, line in enumerate(page.read_text().splitlines(), 1):
            for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", line):
                if not (page.parent / target).exists():
                    missing.append(f"{page.relative_to(ROOT)}:{n}: link to {target}")
    assert not missing, "paths named in the docs that do not exist:\n" + "\n".join(missing)


def test_every_marker_is_known():
    """A marker the tests do not understand would silently skip its block."""
    for b in ALL_BLOCKS:
        if b.marker is None:
            continue
        if b.lang == "python":
            kind, _, device = b.marker.partition(" ")
            assert kind == "needs" and device in KNOWN_DEVICES, (
                f"{b.where}: a python block runs unless marked `needs cuda` or `needs tpu`, got {b.marker!r}")
        elif b.lang in ("sh", "bash"):
            assert b.marker in _SHELL_MARKERS, (
                f"{b.where}: a shell block's markers are {', '.join(map(repr, _SHELL_MARKERS))}, got {b.marker!r}")
        elif b.lang in ("cpp", "cmake"):
            kind, _, arg = b.marker.partition(" ")
            assert kind in ("excerpt", "fragment"), f"{b.where}: unknown cpp marker {b.marker!r}"
            if kind == "excerpt":
                assert (ROOT / arg).is_file(), f"{b.where}: excerpt of {arg}, which does not exist"
        else:
            pytest.fail(f"{b.where}: no docs-test marker applies to a {b.lang!r} block")


# ------------------------------------------------------------- docstrings

_AUTOMODULE = re.compile(r"^\.\. automodule:: (\S+)[ \t]*\n((?:[ \t]+:[\w-]+:.*\n)*)", re.M)

# The modules of the reference that need an optional library, and which: one
# that does not import for want of it is skipped (make docs fails there too).
_OPTIONAL = {"fusetrain.lightning": ("lightning",), "fusetrain.integrations": ("transformers", "accelerate")}


def _reference_modules() -> List[Tuple[str, Optional[List[str]]]]:
    """The modules docs/reference/python.md documents (its ``automodule``
    directives), each with the names its ``:members:`` lists; None where it
    lists none: conf.py's ``members: True`` then documents the module's
    ``__all__``."""
    text = (DOCS / "reference" / "python.md").read_text()
    out = []
    for m in _AUTOMODULE.finditer(text):
        listed = dict(re.findall(r":([\w-]+):[ \t]*(.*)", m.group(2))).get("members", "").strip()
        out.append((m.group(1), [n.strip() for n in listed.split(",") if n.strip()] if listed else None))
    return out


def _where(obj) -> str:
    """file:line of a function, class or property, relative to the repository
    root. A decorator's wrapper (``torch.no_grad()`` on ``step``) is unwrapped:
    the method is where its code is, not torch's wrapper."""
    obj = inspect.unwrap(obj.fget if isinstance(obj, property) else obj)
    try:
        path, line = Path(inspect.getsourcefile(obj)).resolve(), inspect.getsourcelines(obj)[1]
    except (TypeError, OSError):
        return "?"
    return f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{line}"


def _undescribed(fn, doc: str) -> List[str]:
    """The arguments of ``fn`` (not self / cls, *args, **kwargs) that ``doc``
    does not name."""
    try:
        parameters = inspect.signature(fn).parameters.values()  # (follows __wrapped__)
    except (TypeError, ValueError):  # no signature to read (a builtin)
        return []
    return [p.name for p in parameters
            if p.name not in ("self", "cls") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            and not re.search(rf"\b{re.escape(p.name)}\b", doc)]


def _routine_findings(qualname: str, fn) -> List[str]:
    if not fn.__doc__:
        return [f"{_where(fn)}: {qualname}: no docstring"]
    missing = _undescribed(fn, fn.__doc__)
    return [f"{_where(fn)}: {qualname}: arguments not described: {', '.join(missing)}"] if missing else []


def _class_findings(qualname: str, cls) -> List[str]:
    """The class's own docstring (autodoc shows it, and not ``__init__``'s)
    names the arguments of the signature autodoc shows (an inherited
    ``__init__``'s too); each public method, property and nested class of its
    own (autodoc shows no inherited members) has a docstring, a method's naming
    its arguments. A method overriding a base's needs its own."""
    found = []
    if not cls.__doc__:
        found.append(f"{_where(cls)}: {qualname}: no docstring")
    elif not issubclass(cls, enum.Enum):
        missing = _undescribed(cls, cls.__doc__)
        if missing:
            found.append(f"{_where(cls)}: {qualname}: arguments not described: {', '.join(missing)}")
    for name, member in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if isinstance(member, (property, functools.cached_property)):
            if not member.__doc__:
                found.append(f"{_where(member.fget if isinstance(member, property) else member.func)}: "
                             f"{qualname}.{name}: property without docstring")
        elif inspect.isclass(member):
            found += _class_findings(f"{qualname}.{name}", member)
        elif inspect.isroutine(member):
            found += _routine_findings(f"{qualname}.{name}", member)
    return found


def _documented_constant(module, name: str) -> bool:
    """A module-level constant is documented by a ``#:`` comment above its
    assignment: autodoc shows it only then."""
    source = inspect.getsource(module)
    return re.search(rf"^#:.*\n(?:#:.*\n)*{re.escape(name)}\s*[:=]", source, re.M) is not None


@pytest.mark.parametrize("modname,members", _reference_modules(), ids=[m for m, _ in _reference_modules()])
def test_public_names_have_docstrings(modname, members):
    """Issue 40: every public name has a docstring with its arguments. The
    names are those docs/reference/python.md documents: a module's
    ``:members:`` there, else its ``__all__``; a class's own public methods
    and properties. A docstring names each argument (the word, anywhere in
    it); *args and **kwargs are exempt."""
    try:
        module = importlib.import_module(modname)
    except ImportError as e:
        absent = [lib for lib in _OPTIONAL.get(modname, ()) if importlib.util.find_spec(lib) is None]
        if not absent:
            raise
        pytest.skip(f"{modname} does not import without {', '.join(absent)} (not installed here): {e}")
    found = [] if module.__doc__ else [f"{modname}: module without docstring"]
    for name in members if members is not None else getattr(module, "__all__", []):
        obj = getattr(module, name)
        qualname = f"{modname}.{name}"
        if inspect.ismodule(obj):
            continue  # a submodule: documented under its own heading
        if inspect.isclass(obj):
            found += _class_findings(qualname, obj)
        elif callable(obj):
            found += _routine_findings(qualname, obj)
        elif not _documented_constant(module, name):
            found.append(f"{modname}: {qualname}: constant without a #: comment")
    assert not found, (f"public names of {modname} without a docstring, or with arguments it does not "
                       f"describe ({len(found)}):\n" + "\n".join(found))


@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if b.lang in ("cpp", "cmake") and b.marker
                                   and b.marker.startswith("excerpt ")], ids=lambda b: b.where)
def test_cpp_excerpts_match_their_program(block):
    source = [line.strip() for line in (ROOT / block.marker.split(None, 1)[1]).read_text().splitlines()]
    segments, current = [], []
    for line in block.code.splitlines():
        if line.strip() == "// ...":
            segments.append(current)
            current = []
        else:
            current.append(line.strip())
    segments.append(current)
    pos = 0
    for segment in filter(None, segments):
        for start in range(pos, len(source) - len(segment) + 1):
            if source[start:start + len(segment)] == segment:
                pos = start + len(segment)
                break
        else:
            pytest.fail(f"{block.where}: these lines are not in {block.marker.split(None, 1)[1]} "
                        f"(in this order, after the previous ones):\n" + "\n".join(segment))


# The names the C++ guide's examples use without declaring them: each block
# becomes a member function of this struct, so it sees these as a reader's
# program would have them.
_CPP_PRELUDE = r"""
#include <fusetrain/fusetrain.h>

#include <torch/torch.h>

#include <utility>
#include <vector>

using Net = torch::nn::Sequential;

struct DocsExample {
  Net net{torch::nn::Linear(64, 10)};
  at::Tensor x, y;
  std::vector<std::pair<at::Tensor, at::Tensor>> this_ranks_batches;
  std::vector<std::vector<at::Tensor>> batches;
  fusetrain::optim::FusedAdamW opt{net->parameters(), fusetrain::optim::FusedAdamWOptions(1e-3)};
  fusetrain::amp::GradScaler scaler{torch::kCPU};
  c10::intrusive_ptr<c10d::ProcessGroup> group;
"""


def _torch_cxx_standard() -> str:
    """The C++ standard torch's headers need, as its CMake config asks for
    it: C++20 from torch 2.14 (whose headers stop below it; 2.14 says
    ``CXX_STANDARD 20``, 2.15 ``cxx_std_20``), C++17 before."""
    import torch.utils

    config = (Path(torch.utils.cmake_prefix_path) / "Torch" / "TorchConfig.cmake").read_text()
    return "gnu++20" if re.search(r"cxx_std_20|CXX_STANDARD 20\b", config) else "gnu++17"


def test_cpp_examples_compile(tmp_path):
    """Every unmarked cpp block compiles (a syntax and type check against
    the headers, with the names of _CPP_PRELUDE in scope): the C++ guide
    cannot name a class, method or option the library lacks."""
    import torch.utils.cpp_extension

    blocks = [b for b in ALL_BLOCKS if b.lang == "cpp" and b.marker is None]
    if not blocks:
        pytest.skip("no C++ example to compile")
    compiler = os.environ.get("CXX", "c++")
    include = tmp_path / "include"
    include.mkdir()
    (include / "fusetrain").symlink_to(ROOT / "csrc")
    # The version header the build generates beside the link (trainer/model.h).
    (include / "fusetrain_version.h").write_text('#pragma once\n#define FUSETRAIN_VERSION_STRING "0.0.0"\n')
    source = [_CPP_PRELUDE]
    for i, b in enumerate(blocks):
        source += [f"  void example_{i}() {{", f'#line {b.line} "{b.page.relative_to(ROOT)}"', b.code, "  }"]
    source.append("};")
    (tmp_path / "examples.cpp").write_text("\n".join(source))
    cmd = [compiler, f"-std={_torch_cxx_standard()}", "-fsyntax-only", "-DUSE_C10D_GLOO", "-DUSE_DISTRIBUTED",
           f"-I{include}", *[f"-isystem{p}" for p in torch.utils.cpp_extension.include_paths()],
           str(tmp_path / "examples.cpp")]
    p = _run(cmd, cwd=tmp_path, env=dict(os.environ), timeout=300)
    assert p.returncode == 0, p.stdout[-8000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Runs the blocks it reads from stdin (JSON) in one namespace; a failing block
# prints where it is and exits 1.
_RUNNER = r"""
import json, sys, traceback
blocks = json.load(sys.stdin)
ns = {"__name__": "__main__"}
for b in blocks:
    print(f"--- {b['where']}", flush=True)
    try:
        exec(compile(b["code"], b["where"], "exec"), ns)
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        print(f"FAILED: the example at {b['where']}", flush=True)
        sys.exit(1)
"""


def _run(cmd, *, cwd, env, timeout, stdin=None) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(stdin, timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(map(str, cmd))}: no result in {timeout} s\n{out[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def _run_page(page: Path, tmp_path: Path, devices: tuple, before: Optional[int] = None) -> None:
    """Runs the page's python blocks in order in one interpreter: the
    unmarked ones, and those that need one of `devices` (those above line
    `before` only, when given)."""
    runnable = [{"where": b.where, "code": b.code} for b in code_blocks(page)
                if b.lang == "python" and (b.marker is None or b.marker.split()[1] in devices)
                and (before is None or b.line < before)]
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1", MPLBACKEND="Agg", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1")
    p = _run([sys.executable, "-c", _RUNNER], cwd=tmp_path, env=env, timeout=300, stdin=json.dumps(runnable))
    assert p.returncode == 0, p.stdout[-6000:]


@pytest.mark.parametrize("page", PYTHON_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_examples_run(page, tmp_path):
    """The CPU's examples (and a TPU's, where torch_tpu sees one)."""
    _run_page(page, tmp_path, ("tpu",) if _device_present("tpu") else ())


@pytest.mark.cuda
@pytest.mark.parametrize("page", sorted({b.page for b in ALL_BLOCKS if b.lang == "python" and b.marker == "needs cuda"}),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_cuda_examples_run(page, tmp_path):
    """The examples marked `needs cuda`, after their page's others (make gpu-check)."""
    _run_page(page, tmp_path, ("cuda",))


@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if b.lang in ("sh", "bash") and b.marker in _SHELL_MARKERS],
                         ids=lambda b: b.where)
def test_marked_shell_examples_run(block, tmp_path):
    """`run`: from the repository root. `run after python`: as a reader
    copies them, in a fresh directory where the page's python blocks above
    the commands wrote their files (issue 49: the trainer page's "your own
    data" commands failed when copied)."""
    assert (BUILD / "fusetrain").exists(), f"{BUILD / 'fusetrain'} is missing: make build"
    code = block.code.replace("build/fusetrain", str(BUILD / "fusetrain"))
    cwd = ROOT
    if block.marker == "run after python":
        _run_page(block.page, tmp_path, (), before=block.line)
        cwd = tmp_path
    p = _run(["bash", "-e", "-c", code], cwd=cwd, env=dict(os.environ), timeout=120 if cwd == ROOT else 300)
    assert p.returncode == 0, f"{block.where}:\n{p.stdout[-4000:]}"


def _reference_generator():
    """docs/_ext/fusetrain_docs.py, which generates the reference pages
    (``make reference`` runs it as a script; Sphinx loads it as an extension)."""
    spec = importlib.util.spec_from_file_location("fusetrain_docs", DOCS / "_ext" / "fusetrain_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["config.md", "cpp.md", "python.md"])
def test_reference_pages_are_current(name, monkeypatch):
    """Issue 49: docs/reference/*.md hold the generated reference, so that it
    reads as reference in the source tree too, not only after `make docs`.
    Each page is what `make reference` writes: its regions regenerated here
    in memory from the build under test (`fusetrain train --print-schema`),
    the headers and the installed package's docstrings."""
    import difflib

    assert (BUILD / "fusetrain").exists(), f"{BUILD / 'fusetrain'} is missing: make build"
    monkeypatch.setenv("FUSETRAIN_BUILD_DIR", str(BUILD))
    generator = _reference_generator()
    page = DOCS / "reference" / name
    committed = page.read_text()
    assert generator._REGION.search(committed), f"{page.relative_to(ROOT)}: no generated region (its markers are gone)"
    try:
        expected = generator.regenerate(committed)
    except ImportError as e:
        absent = sorted({lib for libs in _OPTIONAL.values() for lib in libs if importlib.util.find_spec(lib) is None})
        if not absent:
            raise
        pytest.skip(f"{page.relative_to(ROOT)} documents modules that need {', '.join(absent)} (not installed here): {e}")
    if committed != expected:
        diff = list(difflib.unified_diff(committed.splitlines(), expected.splitlines(), "committed", "generated",
                                         lineterm="", n=1))
        pytest.fail(f"{page.relative_to(ROOT)} is stale: run `{generator.REFRESH}` (or `FUSETRAIN_BUILD_DIR=build "
                    f"python docs/_ext/fusetrain_docs.py`) to rewrite it from the build, and commit it. "
                    f"The difference ({len(diff)} lines):\n" + "\n".join(diff[:80]))


def test_sphinx_build_has_no_warnings(tmp_path):
    """`make docs` (warnings are errors): every page, link, cross-reference
    and generated reference (autodoc, the config schema, the C++ headers)."""
    missing = [m for m in ("sphinx", "myst_parser", "furo") if _missing(m)]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed: pip install \".[docs]\" (scripts/install-deps.sh does)")
    env = dict(os.environ, FUSETRAIN_BUILD_DIR=str(BUILD), OMP_NUM_THREADS="1")
    p = _run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", "-d",
              str(tmp_path / "doctrees"), str(DOCS), str(tmp_path / "html")], cwd=ROOT, env=env, timeout=300)
    assert p.returncode == 0, p.stdout[-8000:]
    html = (tmp_path / "html" / "reference" / "config.html").read_text()
    assert "optimizer.lr" in html and "precision.policy" in html  # the generated tables are there
    assert "GradScaler" in (tmp_path / "html" / "reference" / "cpp.html").read_text()
    assert "FusedAdamW" in (tmp_path / "html" / "reference" / "python.html").read_text()


def _missing(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None
