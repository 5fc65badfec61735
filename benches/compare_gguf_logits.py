#!/usr/bin/env python3
"""kiln vs llama.cpp on the same GGUF files: the logits of the fixtures.

For each fixture (shared/fixtures/llama, qwen3) and type, GGUF files are
written two ways: by llama.cpp's own `convert_hf_to_gguf.py` (f32, bf16,
q8_0; `benches/llama_cpp_convert.py` runs it) and by kiln
(`examples/to_gguf`: f32, bf16, q8_0, q4_0). Each file is then run by
llama.cpp (`llama-cpp-python`, float32 KV cache, all logits) and by kiln
(`examples/hf_check --model FILE.gguf`, float32 compute) on the fixture's
`input_ids`, and one JSON line per file reports

    max_abs_kiln_vs_llama_cpp   the largest logit difference between the two
    argmax_agreement            the fraction of positions where both pick the same token
    max_abs_kiln_vs_hf          kiln's logits against transformers' (the fixture's golden
    max_abs_llama_cpp_vs_hf     logits, float32 weights) and llama.cpp's
    same_tensors_as_converter   (kiln's files, where the converter writes the type too)
                                whether every tensor holds the converter's bytes

llama.cpp multiplies a quantized weight with activations quantized to 8
bits (Q8_0 / Q8_K), kiln with float32 activations, so on q8_0 / q4_0 files
the two differ by that rounding; f32 files show the two implementations
alone.

Usage:
    PY=$(scripts/setup-llamacpp-venv)
    $PY benches/compare_gguf_logits.py [--fixtures llama,qwen3] [--types f32,bf16,q8_0,q4_0] [--out PATH]
"""
import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile

import numpy as np
from safetensors.numpy import load_file

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = ROOT.parent / "shared" / "fixtures"
CONVERTER_TYPES = {"f32", "f16", "bf16", "q8_0"}


def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        sys.exit(f"{' '.join(map(str, cmd))} failed:\n{r.stdout}\n{r.stderr}")
    return r.stdout


def llama_cpp_logits(path, ids, threads):
    from llama_cpp import Llama

    # GGML_TYPE_F32 = 0: a float32 KV cache, so that f32 files compare the
    # arithmetic alone (llama.cpp's default cache is f16).
    llm = Llama(model_path=str(path), n_ctx=max(64, ids.shape[1]), logits_all=True, verbose=False,
                n_threads=threads, type_k=0, type_v=0)
    out = []
    for row in ids:
        llm.reset()
        llm.eval(row.tolist())
        out.append(np.array(llm.scores[: ids.shape[1]], dtype=np.float32))
    return np.stack(out)


def kiln_logits(path, golden, work):
    out = work / (path.stem + ".kiln.safetensors")
    run([ROOT / "target/release/examples/hf_check", "--model", path, "--input-ids", golden, "--out", out])
    return load_file(str(out))["logits"]


def cpu_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def same_tensors(a, b):
    import gguf

    ta = {t.name: (t.tensor_type, np.asarray(t.data).tobytes()) for t in gguf.GGUFReader(str(a)).tensors}
    tb = {t.name: (t.tensor_type, np.asarray(t.data).tobytes()) for t in gguf.GGUFReader(str(b)).tensors}
    return ta == tb


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", default="llama,qwen3")
    ap.add_argument("--types", default="f32,bf16,q8_0,q4_0")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out")
    a = ap.parse_args()
    run(["cargo", "build", "--release", "--example", "hf_check", "--example", "to_gguf"], cwd=ROOT)
    llama_cpp_dir = pathlib.Path(sys.prefix) / "llama.cpp"
    torch_py = run([ROOT / "scripts/setup-transformers-venv"]).strip().splitlines()[-1]
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        for fixture in a.fixtures.split(","):
            src = FIXTURES / fixture
            golden = src / "golden.safetensors"
            g = load_file(str(golden))
            ids, hf = g["input_ids"], g["logits"]
            for ty in a.types.split(","):
                files = {}
                if ty in CONVERTER_TYPES:
                    files["llama.cpp convert_hf_to_gguf.py"] = work / f"{fixture}-{ty}-converter.gguf"
                    run([torch_py, ROOT / "benches/llama_cpp_convert.py", llama_cpp_dir, src,
                         files["llama.cpp convert_hf_to_gguf.py"], ty])
                files["kiln to_gguf"] = work / f"{fixture}-{ty}-kiln.gguf"
                run([ROOT / "target/release/examples/to_gguf", src, files["kiln to_gguf"], "--type", ty])
                for writer, path in files.items():
                    k = kiln_logits(path, golden, work)
                    l = llama_cpp_logits(path, ids, a.threads)
                    line = {
                        "bench": "gguf_logits", "fixture": fixture, "type": ty, "written_by": writer,
                        "max_abs_kiln_vs_llama_cpp": float(np.abs(k - l).max()),
                        "argmax_agreement": float((k.argmax(-1) == l.argmax(-1)).mean()),
                        "max_abs_kiln_vs_hf": float(np.abs(k - hf).max()),
                        "max_abs_llama_cpp_vs_hf": float(np.abs(l - hf).max()),
                        "cpu": cpu_name(),
                    }
                    if writer == "kiln to_gguf" and len(files) == 2:
                        line["same_tensors_as_converter"] = same_tensors(path, files["llama.cpp convert_hf_to_gguf.py"])
                    print(json.dumps(line), flush=True)
                    lines.append(line)
    if a.out:
        pathlib.Path(a.out).write_text("".join(json.dumps(x) + "\n" for x in lines))


if __name__ == "__main__":
    main()
