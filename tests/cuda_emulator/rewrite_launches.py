#!/usr/bin/env python3
"""Copies a CUDA source for the host compiler: every launch

    kernel<Args><<<grid, block[, shared[, stream]]>>>(a, b, c)

becomes a call of the emulator (tests/cuda_emulator/emulator.h)

    ::cuda_emu::launch(site, ::cuda_emu::LaunchConfig(grid, block, ...),
                       [&](const auto&... p) { kernel<Args>(p...); }, a, b, c)

and nothing else changes. Line breaks are kept and a #line directive names
the original file, so compiler messages, __FILE__ and __LINE__ point into the
real source. Usage: rewrite_launches.py SOURCE OUTPUT [NAME]; NAME is the
file name the emulator reports (default: SOURCE as given).
"""
import re
import sys

OPEN, CLOSE = "<<<", ">>>"
IDENT = re.compile(r"[A-Za-z0-9_:]")


def skip_literal(text, i):
    """Index just past the string or character literal starting at i."""
    quote = text[i]
    i += 1
    while text[i] != quote:
        i += 2 if text[i] == "\\" else 1
    return i + 1


def matching_paren(text, i):
    """Index of the ')' closing the '(' at i (strings and chars skipped)."""
    depth = 0
    while True:
        c = text[i]
        if c in "\"'":
            i = skip_literal(text, i)
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i
        i += 1


def kernel_start(text, end):
    """Start of the kernel expression that ends just before `end` (its
    template argument list included: `ns::kernel<T, f<N>(x)>`)."""
    i = end
    while text[i - 1].isspace():
        i -= 1
    if text[i - 1] == ">":
        depth = 0
        while True:
            i -= 1
            c = text[i]
            if c in ">)":
                depth += 1
            elif c in "<(":
                depth -= 1
                if depth == 0:
                    break
    while i > 0 and IDENT.match(text[i - 1]):
        i -= 1
    return i


def rewrite(text):
    out = []
    pos = 0
    while True:
        open_at = text.find(OPEN, pos)
        if open_at < 0:
            out.append(text[pos:])
            return "".join(out)
        start = kernel_start(text, open_at)
        close_at = text.index(CLOSE, open_at)
        paren = close_at + len(CLOSE)
        while text[paren].isspace():
            paren += 1
        if text[paren] != "(":
            raise SystemExit(f"rewrite_launches: no argument list after the launch at offset {paren}")
        args_end = matching_paren(text, paren)
        kernel = text[start:open_at]
        config = text[open_at + len(OPEN):close_at]
        args = text[paren + 1:args_end]
        name = " ".join(kernel.split()).replace('"', '\\"')
        between = text[close_at + len(CLOSE):paren]  # whitespace, kept for its line breaks
        out.append(text[pos:start])
        out.append(
            f'::cuda_emu::launch(::cuda_emu::LaunchSite{{"{name}", __FILE__, __LINE__, __PRETTY_FUNCTION__}}, '
            f"::cuda_emu::LaunchConfig({config}),{between}"
            f"[&](const auto&... cuda_emu_params) {{ {kernel}(cuda_emu_params...); }}"
            f"{', ' if args.strip() else ''}{args})"
        )
        pos = args_end + 1


def main():
    if len(sys.argv) not in (3, 4):
        raise SystemExit(__doc__)
    source, output = sys.argv[1], sys.argv[2]
    name = sys.argv[3] if len(sys.argv) == 4 else source
    with open(source) as f:
        text = f.read()
    rewritten = f'#line 1 "{name}"\n' + rewrite(text)
    with open(output + ".tmp", "w") as f:
        f.write(rewritten)
    import os

    os.replace(output + ".tmp", output)


if __name__ == "__main__":
    main()
