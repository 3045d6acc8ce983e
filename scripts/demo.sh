#!/usr/bin/env bash
# The main job on the built-in default: setup, build, write the demo checkpoint (configs/demo.json:
# a 4-layer, hidden-64 model with every feature of the real one, random weights, the real NVFP4
# layout, and the Qwen3 tokenizer files fetched by setup.sh), validate it, then generate from it
# with 4 tensor-parallel ranks on the CPU backend. The weights are random: the text is gibberish.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# Everything before the generation logs to stderr, so that stdout carries only the generated text.
bash scripts/setup.sh >&2
bash scripts/build.sh >&2
fngen=./${FN_BUILD_DIR:-build}/fngen
model=demo-model
if [ ! -f "$model/model.safetensors.index.json" ]; then
  rm -rf "$model"
  "$fngen" synth --config configs/demo.json --out "$model" --seed 1 \
    --tokenizer third_party/qwen3-tokenizer >&2
fi
"$fngen" inspect "$model" --tp 4 >&2
# Streams the text on stdout, then the timing summary (TTFT, per-token ms, TPOT percentiles,
# tokens/s, peak memory per rank) on stderr. Extra arguments go to generate (e.g. --json).
mpirun -np 4 --oversubscribe --bind-to none "$fngen" generate --model "$model" \
  --backend cpu --prompt "The capital of France is" --max-new-tokens 16 "$@"
