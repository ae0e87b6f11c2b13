#!/usr/bin/env bash
# Fails when a C++ source (or a C++ snippet in docs/) of accel uses a libtorch API that exists in
# Debian's libtorch 1.13 but not in the libtorch of PyTorch's current wheels, which GPU builds use
# (docs/gpu.md): the Debian build compiles such a call, so nothing else here would notice.
#   scripts/check-libtorch-apis.sh [SOURCE_DIR]
set -euo pipefail
src=$(cd "${1:-$(dirname "$0")/..}" && pwd)
cd "$src"
# pattern<TAB>what to use instead
removed=(
  $'c10::guts\tc10::guts is libtorch'"'"'s C++14 polyfill namespace, emptied release by release (to_string is gone from 2.11): use the standard library, or accel::detail::state_key (runtime/optimizer_steps.h) for an optimizer state key'
)
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t files < <(git ls-files -co --exclude-standard -- '*.cpp' '*.h' '*.hpp' '*.cc' 'docs/*.md')
else
  mapfile -t files < <(find -L . \( -path ./build -o -path './build-*' -o -path ./.git \) -prune -o \
                         \( -name '*.cpp' -o -name '*.h' -o -name '*.hpp' -o -name '*.cc' -o -path './docs/*.md' \) -print)
fi
# file:line:text of every code line: a C++ file's lines, and the lines inside a docs page's
# ```cpp blocks (the page's prose may name an API).
code_lines() {
  local f
  for f in "${files[@]}"; do
    [ -f "$f" ] || continue  # deleted in the work tree, still listed by git
    case "$f" in
      *.md) awk -v f="$f" '/^ *```/ { inside = !inside && $0 ~ /```(cpp|c\+\+)/; next }
                          inside { print f ":" FNR ":" $0 }' "$f" ;;
      *) awk -v f="$f" '{ print f ":" FNR ":" $0 }' "$f" ;;
    esac
  done
}
found=0
for entry in "${removed[@]}"; do
  pattern="${entry%%$'\t'*}" instead="${entry#*$'\t'}"
  # Code only: a line whose text before the pattern holds no '//' (a comment may name the API).
  hits="$(code_lines | awk -v pat="$pattern" '{
            i = index($0, pat); if (i == 0) next
            before = substr($0, 1, i - 1); sub(/^[^:]+:[0-9]+:/, "", before)
            if (index(before, "//") == 0) print }')"
  if [ -n "$hits" ]; then
    found=1
    echo "check-libtorch-apis: '$pattern' is not in current libtorch releases: $instead" >&2
    printf '%s\n' "$hits" | sed 's/^/  /' >&2
  fi
done
[ ${#files[@]} -gt 0 ] || { echo "check-libtorch-apis: no sources found under $src" >&2; exit 2; }
[ $found -eq 0 ] && echo "check-libtorch-apis: no source or docs snippet uses a libtorch API removed after 1.13"
exit $found
