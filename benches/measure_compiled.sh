#!/usr/bin/env bash
# The four measurements of kiln's compiled path, in one run (see the README):
#   (a) ten elementwise ops on 16M floats: DeferAndFuse vs Strict;
#   (b) the llama-16m training step (batch 8 x 256) captured by kiln::compile vs JAX jit
#       on the same XLA:CPU compiler, and vs kiln's CPU backend;
#   (c) a second process's start-up with a warm disk cache vs a cold one (compile time),
#       with JAX's persistent cache on the same step and compiler as the reference;
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
    KILN_CACHE_DIR="$TMP/cache-c" "$BIN" train --preset llama-16m --batch 8 --seq 256 --steps 1 --warmup 2 \
        --device tpu --mode compiled 2>&1 | quiet | tee "$TMP/kiln-$start.json"
done
python3 - "$TMP/kiln-cold.json" "$TMP/kiln-warm.json" <<'PY'
import json, sys
cold, warm = (json.loads(open(p).read().strip().splitlines()[-1]) for p in sys.argv[1:])
c, w = cold["pjrt_compile_s"] + cold["pjrt_disk_load_s"], warm["pjrt_compile_s"] + warm["pjrt_disk_load_s"]
print(f"kiln: cold {c:.3f} s ({cold['pjrt_compiles']} compiles), warm {w:.3f} s "
      f"({warm['pjrt_disk_hits']} loads, {warm['pjrt_compiles']} compiles): {c / w:.1f}x")
PY
echo "   the same step in JAX jit on the same compiler, persistent cache cold then warm (reference)"
if [ -x "$JAXPY" ]; then
    for start in cold warm; do
        "$JAXPY" benches/compare_jax_train.py --preset llama-16m --batch 8 --seq 256 --steps 1 --warmup 0 \
            --skip-kiln --cache-dir "$TMP/jax-cache" --out "$TMP/jax-$start.json" >/dev/null
    done
    python3 - "$TMP/jax-cold.json" "$TMP/jax-warm.json" <<'PY'
import json, sys
cold, warm = (json.loads(open(p).read().strip().splitlines()[-1]) for p in sys.argv[1:])
print(f"jax: cold compile {cold['compile_s']:.3f} s, warm {warm['compile_s']:.3f} s: "
      f"{cold['compile_s'] / warm['compile_s']:.1f}x")
PY
else
    echo "no JAX environment: run scripts/setup-jax-venv"
fi

echo "== (d) kiln-bench train --preset llama-tiny --steps 100 --device tpu --mode compiled (empty cache)"
KILN_CACHE_DIR="$TMP/cache-d" "$BIN" train --preset llama-tiny --batch 4 --seq 64 --steps 100 --warmup 0 \
    --device tpu --mode compiled 2>&1 | quiet | tee "$TMP/kiln-d.json"
# pjrt_compiles counts the compiles of the 100 calls; the cache also holds the
# small programs that built the model and the optimizer state before them.
python3 - "$TMP/kiln-d.json" "$(ls "$TMP/cache-d" | grep -c '\.kxe$')" <<'PY'
import json, sys
r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
print(f"100 captured steps: {r['pjrt_compiles']} compile(s), {r['traces']} traces, {r['replays']} replays, "
      f"{r['retraces']} retraces; programs in the cache, setup included: {sys.argv[2]}")
PY
