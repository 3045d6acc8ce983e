#!/bin/bash
# Tokenizer benchmark (not a test): English prose MB/s on one core, and the long-input timings
# (1 MiB without whitespace, 1 MiB of one character, 1 MiB of one CJK character).
# Prose: Debian's licence texts and /usr/share/doc/*/copyright files (English legal prose),
# about 8 MB, concatenated in sorted order.
# Usage: scripts/tokenizer/bench.sh [BUILD_DIR] [TOKENIZER_DIR]
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
build="${1:-${FN_BUILD_DIR:-$root/build}}"
tok="${2:-$root/third_party/qwen3-tokenizer}"
prose="$(mktemp --suffix=.txt)"
trap 'rm -f "$prose"' EXIT
for f in /usr/share/common-licenses/* /usr/share/doc/*/copyright; do
  [ -f "$f" ] && iconv -f utf-8 -t utf-8 -c "$f" >> "$prose" || true
done
head -c 8000000 "$prose" | iconv -f utf-8 -t utf-8 -c > "$prose.cut" && mv "$prose.cut" "$prose"
echo "# $(nproc) cores visible; pinned to core 0 with taskset" >&2
taskset -c 0 "$build/fngen" tokenize -m "$tok" --bench -f "$prose" "${@:3}"
