#!/usr/bin/env bash
# The tree speaks of the product only: fails, printing file:line of each hit, when a tracked
# file names a work log instead of the product: "session" or "issue" followed by a number, a
# helper's code name (a letter and a digit) or a hand-carried copy folder (dot + "carry"). The
# pattern below is spelled so that it does not match itself.
# Usage: bash tests/tree_words.sh [REPO_ROOT] (default: the checkout holding this script). Exit 0 clean, 1 hits found, 77 not a git checkout (skipped).
set -u
root=${1:-"$(cd "$(dirname "$0")/.." && pwd)"}
cd "$root" || exit 1
if ! git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  echo "tree_words: $root is not a git checkout; skipped"
  exit 77
fi
pattern='sessio[n] [0-9]|issu[e] [0-9]|[.]carr[y]|helpe[r] [a-z][0-9]'
hits=$(git grep -n -i -I -E "$pattern" -- .)
if [ -n "$hits" ]; then
  printf '%s\n' "$hits"
  echo "tree_words: $(printf '%s\n' "$hits" | wc -l) line(s) in" \
    "$(printf '%s\n' "$hits" | cut -d: -f1 | sort -u | wc -l) file(s) name the work, not the product"
  exit 1
fi
echo "tree_words: clean"
