"""Checks the portable artifacts `kiln::export` writes against StableHLO's own.

usage: check_portable.py DIR...

For each export directory: jaxlib's StableHLO (a build independent of the
PJRT plugin kiln runs on) deserializes DIR/program.mlirbc, and serializes
DIR/program.mlir itself for the same target version and deserializes that;
the two modules must print identically (same ops, attributes and types after
the upgrade to jaxlib's StableHLO version). Prints one line per directory.
"""
import json
import sys

from jax._src.interpreters import mlir as jmlir
from jaxlib.mlir.dialects import stablehlo


def check(dir_):
    with open(f"{dir_}/manifest.json") as f:
        m = json.load(f)
    portable = m["portable"]
    if "file" not in portable:
        raise SystemExit(f"{dir_}: no portable artifact: {portable}")
    target = portable["stablehlo_target_version"]
    with open(f"{dir_}/{m['program']['file']}") as f:
        text = f.read()
    with open(f"{dir_}/{portable['file']}", "rb") as f:
        ours = f.read()
    if not ours.startswith(b"ML\xefR") or f"StableHLO_v{target}".encode() not in ours[:64]:
        raise SystemExit(f"{dir_}: the artifact does not start with the bytecode magic and StableHLO_v{target}")
    ctx = jmlir.make_ir_context()
    with ctx:
        theirs = stablehlo.serialize_portable_artifact_str(text, target)
        a = stablehlo.deserialize_portable_artifact(ctx, ours).operation.get_asm(print_generic_op_form=True)
        b = stablehlo.deserialize_portable_artifact(ctx, theirs).operation.get_asm(print_generic_op_form=True)
    if a != b:
        import difflib

        diff = "\n".join(list(difflib.unified_diff(b.splitlines(), a.splitlines(), "stablehlo", "kiln", lineterm=""))[:40])
        raise SystemExit(f"{dir_}: kiln's artifact differs from StableHLO's serialization:\n{diff}")
    print(
        f"{dir_}: artifact ({len(ours)} bytes, target {target}) read by StableHLO {stablehlo.get_current_version()}"
        f" equals StableHLO's own serialization ({len(theirs)} bytes)"
    )


if __name__ == "__main__":
    for d in sys.argv[1:]:
        check(d)
