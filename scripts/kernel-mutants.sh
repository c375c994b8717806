#!/usr/bin/env bash
# The mutant check of the CUDA kernel tests (issue 37): for each mutant of
# tests/kernel_mutants.txt (one planted bug in one file of csrc/kernels),
# builds the sanitized fusetrain_kernel_tests_mutant from a copy of
# csrc/kernels with that bug (cmake/KernelEmulatorTests.cmake; the real files
# are never touched) and requires its tests to fail. Prints one line per
# mutant, CAUGHT or MISSED with the first failing assertion or sanitizer
# error, and exits nonzero when a mutant is missed (known test holes, marked
# in the list, aside) or when the unmutated copy, run first as the control,
# fails.
#
# Takes 7 to 12 minutes on 2 cores with the rest of the build up to date (15
# mutants: 7 min with ccache warm on an idle machine, 12 min on the first run
# on a busy one): the control runs every test spec the mutants use, some in
# both orders (sanitized, 4-7 min); then each mutant recompiles the kernel
# file it changes and the one it restores (5-15 s each, all of them for a
# header; the first run also builds the mutant library) and runs until its
# first failure (--abort), a missed one through its whole spec. Not part of
# `make test` for that reason: `make kernel-mutants`.
#
# Usage: scripts/kernel-mutants.sh [BUILD_DIR]
#   MUTANTS="name ..."  only these mutants (the control then runs only their specs)
#   JOBS=N              build parallelism (default 2)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
LIST=tests/kernel_mutants.txt
JOBS=${JOBS:-2}
# Builds share the machine with other builds of this tree: one at a time.
LOCK=/tmp/fusetrain-build.lock
# A mutant can make a kernel loop forever; a run this long counts as failed.
RUN_TIMEOUT=${KERNEL_MUTANT_TIMEOUT:-900}
BIN=$BUILD/fusetrain_kernel_tests_mutant
LOGS=$BUILD/kernel_mutant_logs
PRISTINE=$BUILD/kernel_mutant_pristine

if [ ! -f "$BUILD/CMakeCache.txt" ]; then
  echo "kernel-mutants: $BUILD is not configured (make build)" >&2
  exit 1
fi
# The copy's place is the cache's FUSETRAIN_KERNEL_MUTANT_DIR; a tree
# configured before the variable existed is reconfigured once to get it.
mutant_dir() { sed -n 's/^FUSETRAIN_KERNEL_MUTANT_DIR:PATH=//p' "$BUILD/CMakeCache.txt"; }
if [ -z "$(mutant_dir)" ]; then
  flock "$LOCK" cmake "$BUILD" >/dev/null
fi
MUTANT_DIR=$(mutant_dir)
if [ -z "$MUTANT_DIR" ]; then
  echo "kernel-mutants: no FUSETRAIN_KERNEL_MUTANT_DIR in $BUILD/CMakeCache.txt: the kernel" \
       "emulator tests are not configured (no cuda_fp16.h? see the CMake output)" >&2
  exit 1
fi

# The list's parser, the mutation itself and the failure summaries, in Python:
# exact substring counts and multi-line text are awkward in bash.
HELPER=$(cat <<'PY'
import os, re, sys

def parse(path):
    mutants, cur, block = [], None, None
    for n, line in enumerate(open(path).read().split("\n"), 1):
        where = f"{path}:{n}"
        if block is not None:
            if line in ("--- to", "--- end"):
                cur[block] = "\n".join(cur[block])
                if line == "--- to":
                    if block != "from":
                        sys.exit(f"{where}: '--- to' outside a '--- from' block")
                    block, cur["to"] = "to", []
                else:
                    if block != "to":
                        sys.exit(f"{where}: '--- end' before '--- to'")
                    block, cur = None, None
            else:
                cur[block].append(line)
            continue
        if not line.strip() or line.startswith("#"):
            continue
        if line == "--- from":
            if cur is None:
                sys.exit(f"{where}: '--- from' before 'mutant:'")
            block, cur["from"] = "from", []
            continue
        m = re.match(r"(\w+):\s*(.*)$", line)
        if not m:
            sys.exit(f"{where}: expected 'key: value', '--- from' or a comment: {line!r}")
        key, value = m.groups()
        if key == "mutant":
            cur = {"mutant": value, "orders": "forward", "expect": "caught", "line": n}
            mutants.append(cur)
        elif cur is None:
            sys.exit(f"{where}: '{key}:' before 'mutant:'")
        elif key in ("file", "what", "tests", "orders", "expect"):
            cur[key] = value
        else:
            sys.exit(f"{where}: unknown key {key!r}")
    if block is not None:
        sys.exit(f"{path}: the last mutant's text is not closed by '--- end'")
    names = set()
    for m in mutants:
        where = f"{path}:{m['line']} ({m['mutant']})"
        for key in ("file", "what", "tests", "from", "to"):
            if key not in m:
                sys.exit(f"{where}: no {key}")
        if m["mutant"] in names or not re.fullmatch(r"[\w.-]+", m["mutant"]):
            sys.exit(f"{where}: the name must be unique, of letters, digits, '.', '_', '-'")
        names.add(m["mutant"])
        if m["from"] == m["to"]:
            sys.exit(f"{where}: the replacement equals the original")
        if m["expect"] not in ("caught", "missed"):
            sys.exit(f"{where}: expect must be caught or missed")
        if not set(m["orders"].split()) <= {"forward", "reverse"} or not m["orders"].split():
            sys.exit(f"{where}: orders must be forward and/or reverse")
    return mutants

def source(m, kernel_dir):
    path = os.path.join(kernel_dir, m["file"])
    if not os.path.isfile(path):
        sys.exit(f"mutant {m['mutant']}: no {path}")
    text = open(path).read()
    count = text.count(m["from"])
    if count != 1:
        sys.exit(f"mutant {m['mutant']}: its original text occurs {count} times in {path}, not once"
                 f" (the kernel changed? update {sys.argv[2]}):\n{m['from']}")
    return path, text

def check(path, kernel_dir):
    # One tab-separated line per mutant for the shell, after checking them all.
    mutants = parse(path)
    for m in mutants:
        source(m, kernel_dir)
    for m in mutants:
        print("\t".join(m[k] for k in ("mutant", "file", "tests", "orders", "expect", "what")))

def apply(path, name, kernel_dir):
    (m,) = [m for m in parse(path) if m["mutant"] == name]
    file, text = source(m, kernel_dir)
    with open(file, "w") as f:
        f.write(text.replace(m["from"], m["to"]))

def summary(log, status):
    # The first failure in a test run's output, on one line.
    lines = open(log, errors="replace").read().splitlines()
    shorten = lambda s: s.replace(os.getcwd() + "/", "").strip()
    for i, line in enumerate(lines):
        m = re.search(r"ERROR: AddressSanitizer: (.*?)( on address .*)?$", line)
        if m:  # the kind, the access, and the first frame with a source line
            access = next((l.split(" at 0x")[0].strip() for l in lines[i + 1:]
                           if re.match(r"(READ|WRITE) of size", l)), "")
            frame = next((l.rsplit(" ", 1)[-1] for l in lines[i + 1:]
                          if re.match(r"\s*#\d+ 0x\w+ in .* \S+:\d+(:\d+)?$", l)), "")
            return shorten(f"AddressSanitizer: {m.group(1)} ({access}) at {frame}")
        if "runtime error:" in line:
            return "UBSan: " + shorten(line)
        m = re.match(r"(\S+?):(\d+): failed: (.*)$", line)
        if m:  # Catch2's compact reporter: file:line: failed: expr for: ... with N messages: 'a' and 'b'
            file, num, rest = m.groups()
            expr, _, messages = rest.partition(" with ")
            found = [s for s in re.findall(r"'((?:[^']|'(?! and '|$))*)'", messages)
                     if s.strip() != "emulator:"]  # REQUIRE_LAUNCH's, when the emulator said nothing
            # The emulator's message or else the last INFO says what differed.
            detail = next((s for s in found if s.startswith("emulator: ")),
                          found[-1] if found else "")
            # Then the captures that name the failing case, in order.
            rest = [s for s in found if s != detail]
            out = f"{os.path.basename(file)}:{num}: {expr.strip()}"
            return out + "".join(f" -- {s}" for s in [detail, "; ".join(rest)] if s)
    if status == 124:
        return f"timed out (the run took over {os.environ.get('RUN_TIMEOUT', '?')} s)"
    tail = [l for l in lines if l.strip()]
    return f"exit status {status}: " + (shorten(tail[-1]) if tail else "no output")

commands = {"check": check, "apply": apply, "summary": lambda log, s: print(summary(log, int(s)))}
commands[sys.argv[1]](*sys.argv[2:])
PY
)
helper() { python3 -c "$HELPER" "$@"; }

elapsed() { echo "$(($(date +%s) - $1)) s"; }
START=$(date +%s)
mkdir -p "$LOGS"

# The kernels as they are now, copied once: every build of this run starts
# from the same sources. The tests and the emulator are compiled from the
# tree itself, so an edit of any of them during the run (or of the kernels,
# whose headers the tests include) would pair one version's tests with
# another's kernels: the run stops instead of reporting on such a mix.
fingerprint() {
  find csrc/kernels tests/kernels tests/cuda_emulator -type f -print0 | sort -z |
    xargs -0 sha1sum | sha1sum
}
unchanged() {
  if [ "$(fingerprint)" != "$FINGERPRINT" ]; then
    echo "kernel-mutants: csrc/kernels, tests/kernels or tests/cuda_emulator changed during" \
         "the run: its results would mix two versions; run it again" >&2
    exit 1
  fi
}
FINGERPRINT=$(fingerprint)
rm -rf "$PRISTINE"
cp -r csrc/kernels "$PRISTINE"

# Every mutant is checked before anything is built: one whose text no longer
# occurs exactly once stops the run here.
records=$(helper check "$LIST" "$PRISTINE")
if [ -n "${MUTANTS:-}" ]; then
  records=$(awk -F'\t' -v want=" $MUTANTS " 'index(want, " " $1 " ")' <<<"$records")
  [ -n "$records" ] || { echo "kernel-mutants: no mutant named in MUTANTS=$MUTANTS" >&2; exit 1; }
fi

# Makes the copy equal to the snapshot, rewriting only the files that
# differ: ninja rebuilds by timestamps, so an unchanged file keeps its own (no
# needless recompiles) and a restored one gets a new one (cp -p would give it
# a timestamp older than the objects built from the mutant: never rebuilt).
sync_copy() {
  local f
  mkdir -p "$MUTANT_DIR"
  for f in "$MUTANT_DIR"/*; do
    if [ -e "$f" ] && [ ! -e "$PRISTINE/$(basename "$f")" ]; then rm -rf "$f"; fi
  done
  for f in "$PRISTINE"/*; do
    cmp -s "$f" "$MUTANT_DIR/$(basename "$f")" || cp "$f" "$MUTANT_DIR/"
  done
}

# build NAME: builds the mutant binary from the copy; the log goes to LOGS.
build() {
  flock "$LOCK" cmake --build "$BUILD" -j "$JOBS" --target fusetrain_kernel_tests_mutant \
    </dev/null >"$LOGS/$1.build.log" 2>&1
}

# run_tests SPEC ORDER LOG: runs SPEC in ORDER, stopping at the first failed
# assertion; prints the exit status (0: every test passed). A sticky emulator
# error fails the REQUIRE_LAUNCH of the launch that met it, a sanitizer report
# ends the process with status 1, and a run that times out (a mutant that
# hangs, as it would hang `make test`) with 124: all count as failures.
run_tests() {
  local status=0
  ASAN_OPTIONS=detect_leaks=0 CUDA_EMULATOR_ORDER=$2 timeout "$RUN_TIMEOUT" \
    "$BIN" --abort --reporter compact "$1" </dev/null >"$3" 2>&1 || status=$?
  echo "$status"
}

# The control: the unmutated copy must build and pass every spec, in every
# order, that the mutants use; otherwise a failure proves nothing.
echo "== control: the unmutated copy of csrc/kernels ($MUTANT_DIR)"
sync_copy
if ! build control; then
  echo "kernel-mutants: the unmutated copy does not build ($LOGS/control.build.log):" >&2
  tail -n 30 "$LOGS/control.build.log" >&2
  exit 1
fi
declare -A seen
while IFS=$'\t' read -r name file spec orders expect what; do
  for order in $orders; do
    [ -z "${seen[$spec $order]:-}" ] || continue
    seen[$spec $order]=1
    t0=$(date +%s)
    log=$LOGS/control.${spec//[^A-Za-z0-9_]/}.$order.log
    status=$(run_tests "$spec" "$order" "$log")
    if [ "$status" != 0 ]; then
      echo "kernel-mutants: the unmutated copy fails $spec ($order): $(RUN_TIMEOUT=$RUN_TIMEOUT helper summary "$log" "$status") ($log)" >&2
      exit 1
    fi
    echo "passes $spec ($order, $(elapsed "$t0"))"
  done
done <<<"$records"

echo "== mutants"
failures=0
caught=0
total=0
while IFS=$'\t' read -r name file spec orders expect what; do
  t0=$(date +%s)
  total=$((total + 1))
  unchanged
  sync_copy
  helper apply "$LIST" "$name" "$MUTANT_DIR"
  if ! build "$name"; then
    # A mutant that does not compile tests nothing: the list needs fixing.
    printf 'BROKEN  %-32s %s -- does not compile (%s)\n' "$name" "$what" "$LOGS/$name.build.log"
    failures=$((failures + 1))
    continue
  fi
  first=""
  caught_in=""
  for order in $orders; do
    log=$LOGS/$name.$order.log
    status=$(run_tests "$spec" "$order" "$log")
    if [ "$status" != 0 ]; then
      caught_in="$caught_in $order"
      [ -n "$first" ] || first=$(RUN_TIMEOUT=$RUN_TIMEOUT helper summary "$log" "$status")
    fi
  done
  took=$(elapsed "$t0")
  if [ -n "$caught_in" ]; then
    caught=$((caught + 1))
    note=""
    if [ "$expect" = missed ]; then
      # Good news, but the list must say so: a stale mark would hide a regression.
      note=" [listed as a known hole: set it to expect: caught]"
      failures=$((failures + 1))
    fi
    [ "$orders" = forward ] || note=" [in:$caught_in]$note"
    printf 'CAUGHT  %-32s %s (%s, %s)%s -- %s\n' "$name" "$what" "$file" "$took" "$note" "$first"
  elif [ "$expect" = missed ]; then
    printf 'MISSED  %-32s %s (%s, %s) [known test hole]\n' "$name" "$what" "$file" "$took"
  else
    printf 'MISSED  %-32s %s (%s, %s) -- %s passed in: %s\n' "$name" "$what" "$file" "$took" \
      "$spec" "$orders"
    failures=$((failures + 1))
  fi
done <<<"$records"

unchanged
# The copy is left unmutated (the binary is the last mutant's until rebuilt).
sync_copy
echo "== $caught of $total mutants caught, $failures failure(s), $(elapsed "$START") (logs: $LOGS)"
[ "$failures" = 0 ]
