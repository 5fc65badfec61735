"""Dequantizes a compressed-tensors checkpoint directory independently of kiln
(numpy only, bit-level decoding) and writes every quantized weight as float32.

    python check_quantized_checkpoint.py DIR OUT.safetensors

Reads DIR/config.json's quantization_config (quant_method compressed-tensors,
format float-quantized / nvfp4-pack-quantized / mxfp4-pack-quantized) and parses
DIR/model.safetensors itself (header length, JSON header, raw bytes), since
numpy has no float8. Formulas, as compressed-tensors defines them:
  FP8:   W = f32(e4m3(weight)) * f32(weight_scale[block])      (tensor, channel, block)
  NVFP4: W = e2m1(nibble) * (f32(e4m3(weight_scale[i, j//16])) / weight_global_scale)
  MXFP4: W = e2m1(nibble) * 2^(weight_scale[i, j//32] - 127)
Packed FP4: byte j of a row holds element 2j in the low nibble, 2j+1 in the high one.
Exits non-zero, naming the problem, on anything it does not expect.
"""
import json
import struct
import sys

import numpy as np
from safetensors.numpy import save_file


def fail(msg):
    print(f"check_quantized_checkpoint: {msg}", file=sys.stderr)
    sys.exit(1)


def read_safetensors(path):
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    body = raw[8 + n :]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        out[name] = (info["dtype"], info["shape"], body[a:b])
    return header.get("__metadata__", {}), out


def e4m3(codes):
    c = codes.astype(np.int32)
    s = np.where(c & 0x80, -1.0, 1.0)
    e = (c >> 3) & 0xF
    m = (c & 7).astype(np.float64)
    v = np.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * np.exp2(e.astype(np.float64) - 7))
    v = np.where((c & 0x7F) == 0x7F, np.nan, v)
    return (s * v).astype(np.float32)


E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float32)


def e2m1(packed, out, inp):
    b = packed.reshape(out, inp // 2).astype(np.int32)
    codes = np.stack([b & 0xF, b >> 4], axis=-1).reshape(out, inp)
    v = E2M1[codes & 7]
    return np.where(codes & 8, -v, v).astype(np.float32)


def array(t, expect):
    dt, shape, data = t
    if dt not in expect:
        fail(f"dtype {dt}, expected one of {expect}")
    np_dt = {"F32": np.float32, "BF16": np.uint16, "U8": np.uint8, "F8_E4M3": np.uint8, "F8_E8M0": np.uint8}[dt]
    a = np.frombuffer(data, dtype=np_dt).reshape(shape)
    if dt == "BF16":
        a = (a.astype(np.uint32) << 16).view(np.float32)
    return dt, a


def main():
    d, out_path = sys.argv[1], sys.argv[2]
    q = json.load(open(f"{d}/config.json")).get("quantization_config") or fail("no quantization_config")
    if q.get("quant_method") != "compressed-tensors":
        fail(f"quant_method {q.get('quant_method')}")
    (group,) = q["config_groups"].values()
    fmt, w = group["format"], group["weights"]
    meta, ts = read_safetensors(f"{d}/model.safetensors")
    if meta.get("format") != "pt":
        fail(f"metadata {meta}: transformers requires format pt")
    result = {}
    modules = sorted({k.rsplit(".", 1)[0] for k in ts if k.endswith(".weight_scale")})
    for m in modules:
        if fmt == "float-quantized":
            _, codes = array(ts[f"{m}.weight"], ["F8_E4M3"])
            _, s = array(ts[f"{m}.weight_scale"], ["F32", "BF16"])
            out, inp = codes.shape
            if w["strategy"] == "block":
                br, bc = w["block_structure"]
            elif w["strategy"] == "channel":
                br, bc = 1, inp
            else:
                br, bc = out, inp
            if s.shape != (-(-out // br), -(-inp // bc)):
                fail(f"{m}.weight_scale shape {s.shape} for blocks {br}x{bc} of [{out}, {inp}]")
            full = np.repeat(np.repeat(s, br, axis=0), bc, axis=1)[:out, :inp]
            W = e4m3(codes) * full
        else:
            _, packed = array(ts[f"{m}.weight_packed"], ["U8"])
            out, inp = packed.shape[0], packed.shape[1] * 2
            g = w["group_size"]
            if fmt == "nvfp4-pack-quantized":
                _, s = array(ts[f"{m}.weight_scale"], ["F8_E4M3"])
                _, gs = array(ts[f"{m}.weight_global_scale"], ["F32"])
                eff = (e4m3(s) / gs.reshape(())).astype(np.float32)
            elif fmt == "mxfp4-pack-quantized":
                _, s = array(ts[f"{m}.weight_scale"], ["U8", "F8_E8M0"])
                eff = np.ldexp(np.float32(1), s.astype(np.int32) - 127).astype(np.float32)
            else:
                fail(f"format {fmt}")
            if eff.shape != (out, -(-inp // g)):
                fail(f"{m}.weight_scale shape {eff.shape} for groups of {g} of [{out}, {inp}]")
            W = e2m1(packed, out, inp) * np.repeat(eff, g, axis=1)[:, :inp]
        result[f"{m}.weight"] = np.ascontiguousarray(W.astype(np.float32))
    if not result:
        fail("no quantized modules")
    save_file(result, out_path)
    print(json.dumps({"ok": True, "modules": len(result)}))


main()
