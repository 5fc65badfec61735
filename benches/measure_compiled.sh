#!/usr/bin/env bash
# The four measurements of kiln's compiled path, in one run (see the README):
#   (a) ten elementwise ops on 16M floats: DeferAndFuse vs Strict;
#   (b) the llama-16m training step (batch 8 x 256) captured by kiln::compile vs JAX jit
#       on the same XLA:CPU compiler, and vs kiln's CPU backend;
#   (c) a second process's start-up with a warm disk cache vs a cold one (compile time);
#   (d) compilations over 100 captured training steps (llama-tiny), against distinct programs.
# Usage: benches/measure_compiled.sh   (builds kiln-bench; needs scripts/setup-jax-venv for (b))
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

cargo build --release -p kiln-bench >&2
BIN=target/release/kiln-bench
JAXPY="${KILN_JAX_VENV:-$HOME/.cache/kiln/jax-venv}/bin/python"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
quiet() { grep -v '^WARNING\|^I0000' || true; }

echo "== (a) kiln-bench chain --device tpu"
"$BIN" chain --device tpu 2>&1 | quiet

echo "== (b) benches/compare_jax_train.py --preset llama-16m --batch 8 --seq 256"
if [ -x "$JAXPY" ]; then
    "$JAXPY" benches/compare_jax_train.py --preset llama-16m --batch 8 --seq 256 --steps 8 --kiln-bin "$BIN"
else
    echo "no JAX environment: run scripts/setup-jax-venv"
fi

echo "== (c) kiln-bench train --preset llama-16m --device tpu --mode compiled, cold then warm disk cache"
for start in cold warm; do
    printf '%s: ' "$start"
    KILN_CACHE_DIR="$TMP/cache-c" "$BIN" train --preset llama-16m --batch 8 --seq 256 --steps 1 --warmup 3 \
        --device tpu --mode compiled 2>&1 | quiet
done

echo "== (d) kiln-bench train --preset llama-tiny --steps 100 --device tpu --mode compiled (empty cache)"
KILN_CACHE_DIR="$TMP/cache-d" "$BIN" train --preset llama-tiny --batch 4 --seq 64 --steps 100 --warmup 0 \
    --device tpu --mode compiled 2>&1 | quiet
echo "distinct programs written to the cache: $(ls "$TMP/cache-d" | grep -c '\.kxe$')"
