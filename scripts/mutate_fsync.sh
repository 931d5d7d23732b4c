#!/usr/bin/env bash
# Mutation test of the checkpoint's durability: remove each sync of dsio/checkpoint in turn (an
# fsync of a file or directory, an engine fsync, a sync flag) and show that a test fails.
#
#   scripts/mutate_fsync.sh            # all sites; ~10 s per site on a quiet 2-core machine
#   scripts/mutate_fsync.sh --list     # just list the sites
#
# Works on a private copy of the working tree (never edits the checkout), with the editable
# install's import hook disabled so that the copy is what gets imported. Exit status 1 if any
# mutant survives (no test failed without that sync).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
TESTS="${MUTATE_TESTS:-tests/dsio/checkpoint/test_durability.py}"

SITES="$("$PY" - "$ROOT" <<'EOF'
import re, sys, pathlib
root = pathlib.Path(sys.argv[1])
pat = re.compile(r"os\.fsync\(fd\)|_fs\.fsync_dir\([^)]*\)|await (?:self\._file|f)\.fsync\(\)|fsync=self\.sync_files")
for f in sorted((root / "dsio/checkpoint").glob("*.py")):
    for n, line in enumerate(f.read_text().splitlines(), 1):
        if line.lstrip().startswith("#"):
            continue
        if pat.search(line):
            print(f"{f.relative_to(root)}:{n}")
EOF
)"
if [[ "${1:-}" == "--list" ]]; then echo "$SITES"; exit 0; fi

WORK="$(mktemp -d /tmp/dsio-mutate.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
SO="$("$PY" -c 'import dsio._C as c; print(c.__file__)')"
killed=0; survived=0
for site in unmutated $SITES; do
  file="${site%%:*}"; line="${site##*:}"
  rm -rf "$WORK/tree"; mkdir -p "$WORK/tree/tests/dsio"
  cp -r "$ROOT/dsio" "$WORK/tree/dsio"; cp "$SO" "$WORK/tree/dsio/"
  cp -r "$ROOT/tests/dsio/checkpoint" "$WORK/tree/tests/dsio/"; cp "$ROOT"/tests/*.py "$WORK/tree/tests/"
  cp "$ROOT/pyproject.toml" "$WORK/tree/"
  printf 'import sys\nsys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__]\n' \
    > "$WORK/tree/sitecustomize.py"
  if [[ "$site" == unmutated ]]; then  # the copy must pass as it is, or no kill below means anything
    if ! (cd "$WORK/tree" && PYTHONPATH="$WORK/tree" timeout 300 "$PY" -m pytest -q -x -p no:cacheprovider $TESTS >"$WORK/log" 2>&1); then
      echo "the unmutated copy fails its tests; fix that first:"; tail -20 "$WORK/log"; exit 2
    fi
    echo "unmutated copy passes: $(tail -1 "$WORK/log")"; continue
  fi
  "$PY" - "$WORK/tree/$file" "$line" <<'EOF'
import re, sys
path, n = sys.argv[1], int(sys.argv[2])
lines = open(path).read().split("\n")
old = lines[n - 1]
new = re.sub(r"fsync=self\.sync_files", "fsync=False", old)
new = re.sub(r"await (?:self\._file|f)\.fsync\(\)", "None", new)
new = re.sub(r"os\.fsync\(fd\)|_fs\.fsync_dir\([^)]*\)", "None", new)
assert new != old, old
lines[n - 1] = new
open(path, "w").write("\n".join(lines))
EOF
  if (cd "$WORK/tree" && PYTHONPATH="$WORK/tree" timeout 300 "$PY" -m pytest -q -x -p no:cacheprovider $TESTS >"$WORK/log" 2>&1); then
    echo "SURVIVED  $site: $(sed -n "${line}p" "$ROOT/$file" | sed 's/^ *//')"
    survived=$((survived + 1))
  else
    why="$(grep -m1 -E '^(FAILED|ERROR) ' "$WORK/log" | cut -c1-160 || true)"
    echo "killed    $site: $(sed -n "${line}p" "$ROOT/$file" | sed 's/^ *//')"
    echo "            <- ${why:-$(tail -1 "$WORK/log")}"
    killed=$((killed + 1))
  fi
done
echo "mutate_fsync: $killed killed, $survived survived"
[[ $survived -eq 0 ]]
