#!/usr/bin/env python3
"""The `gguf` package (llama.cpp's own Python reader, writer and quantizers)
on the GGUF side of kiln's tests (`nn/tests/gguf.rs`).

    gguf_reference.py make OUT.gguf OUT_REF.safetensors SEED
        Writes a GGUF file with a tensor of every type kiln reads, on shapes
        that are not multiples of anything but the block: the 32-element
        types quantized from random values by `gguf.quants.quantize`, the
        K types as random blocks (their f16 scales drawn finite), the plain
        types as random values. OUT_REF holds each tensor dequantized by
        `gguf.quants.dequantize`, in float32, under the same name.

    gguf_reference.py convert HF_DIR OUT.gguf
        Writes a Llama or Qwen3 checkpoint directory (float32) as llama.cpp's
        `convert_hf_to_gguf.py` does, F32 throughout: its metadata calls,
        `gguf.TensorNameMap` for the names, its `permute` of q_proj / k_proj
        rows for the `llama` architecture, no output.weight when tied.

    gguf_reference.py check-model KILN.gguf HF_DIR
        Checks a GGUF model kiln wrote (F32) against the checkpoint it came
        from, by the same rules: every tensor where `convert` would put it.

    gguf_reference.py tokenizer OUT_DIR PRE TEXT_FILE
        Trains a small byte-level BPE (the `tokenizers` package) whose split
        regex is the one llama.cpp names PRE (qwen2, llama-bpe, gpt-2), with
        special tokens, on TEXT_FILE; writes OUT_DIR/tokenizer.json, the same
        tokenizer as llama.cpp's converter stores it in OUT_DIR/tokenizer.gguf
        (tokens by id, token types, merges, the pre-tokenizer's name), and
        OUT_DIR/expected.json: the ids the package encodes SAMPLES to.

    gguf_reference.py check KILN.gguf SOURCE.safetensors
        Reads a GGUF file kiln wrote: prints its metadata as JSON (one
        [type, value] per key) on stdout, and checks that every tensor holds
        exactly the bytes `gguf.quants.quantize` makes of the float32 source
        of the same name, with PyTorch's shape reversed into GGUF's `ne`.
"""
import json
import sys

import numpy as np
from safetensors.numpy import load_file, save_file

import gguf
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize


def random_k_blocks(rng, qtype, rows, cols):
    """Random bytes for `rows` x `cols` elements of a K type, with each f16
    field (d, dmin) replaced by a finite value of a weight's magnitude."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = rows * cols // block
    b = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    f16_fields = {T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}[qtype]
    for at in f16_fields:
        b[:, at:at + 2] = (rng.standard_normal(n) * 0.01).astype(np.float16).view(np.uint8).reshape(n, 2)
    return b.reshape(rows, cols // block * size)


def make(out, ref, seed):
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(out, "llama")
    w.add_uint32("test.u32", 7)
    w.add_string("test.str", "héllo")
    w.add_array("test.strings", ["a", "", "ç"])
    w.add_float32("test.f32", 0.25)
    refs = {}
    plain = {T.F32: np.float32, T.F16: np.float16, T.BF16: None}
    for qtype, dt in plain.items():
        x = rng.standard_normal((5, 33)).astype(np.float32)
        if dt is None:
            raw = quantize(x, qtype)
            w.add_tensor(f"plain.{qtype.name}", raw, raw_shape=raw.shape, raw_dtype=qtype)
            refs[f"plain.{qtype.name}"] = dequantize(raw, qtype)
        else:
            w.add_tensor(f"plain.{qtype.name}", x.astype(dt))
            refs[f"plain.{qtype.name}"] = x.astype(dt).astype(np.float32)
    for qtype in [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]:
        # 7 rows of 96: three blocks per row, with an all-zero block (scale 0).
        x = rng.standard_normal((7, 96)).astype(np.float32)
        x[3, 32:64] = 0
        raw = quantize(x, qtype)
        w.add_tensor(f"q.{qtype.name}", raw, raw_shape=raw.shape, raw_dtype=qtype)
        refs[f"q.{qtype.name}"] = dequantize(raw, qtype)
    for qtype in [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]:
        raw = random_k_blocks(rng, qtype, 3, 512)
        w.add_tensor(f"k.{qtype.name}", raw, raw_shape=raw.shape, raw_dtype=qtype)
        refs[f"k.{qtype.name}"] = dequantize(raw, qtype)
    # A 3-D tensor: GGUF's ne is the reverse of the shape.
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    raw = quantize(x, T.Q8_0)
    w.add_tensor("q.3d", raw, raw_shape=raw.shape, raw_dtype=T.Q8_0)
    refs["q.3d"] = dequantize(raw, T.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in refs.items()}, ref)


def field_value(f):
    t = f.types[0]
    if t == gguf.GGUFValueType.ARRAY:
        # parts: key length, key, value type, item type, count, items...; the
        # item type from the file itself, as `types` omits it when empty.
        item = gguf.GGUFValueType(int(f.parts[3][0]))
        return [item.name, f.contents() if f.data else []]
    return f.contents()


def check(path, source):
    r = gguf.GGUFReader(path)
    meta = {}
    for name, f in r.fields.items():
        if name.startswith("GGUF."):
            continue
        v = field_value(f)
        if isinstance(v, float) and not np.isfinite(v):
            v = repr(v)
        meta[name] = [f.types[0].name, v]
    src = load_file(source)
    seen = set()
    for t in r.tensors:
        seen.add(t.name)
        x = src[t.name].astype(np.float32)
        want = quantize(x, t.tensor_type)
        got = np.asarray(t.data)
        assert list(t.shape) == list(reversed(x.shape)), (t.name, list(t.shape), x.shape)
        assert got.tobytes() == np.ascontiguousarray(want).tobytes(), f"{t.name}: bytes differ from gguf.quants.quantize"
    assert seen == set(src), (sorted(seen), sorted(src))
    print(json.dumps(meta, ensure_ascii=False))


PATTERNS = {
    "gpt-2": r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}

SAMPLES = [
    "Hello world",
    "  leading spaces and trailing  ",
    "Numbers 1234567 and 3.14159, dates 2026-12-05",
    "Contractions: I'LL, you've, they'd, it's",
    "New\nlines\r\n\n\ttabs",
    "Unicode: café cafe\u0301 naïve 東京 🙂",
    "<|im_start|>user\nWhat is 12+34?<|im_end|>\n<|im_start|>assistant\n",
    "ROMEO: But soft, what light through yonder window breaks?",
]


def tokenizer(out_dir, pre, text_file):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(ignore_merges=(pre == "llama-bpe")))
    if pre == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PATTERNS[pre]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = open(text_file, encoding="utf-8").read()[:200_000]
    tok.train_from_iterator([text], trainer=trainer)
    tok.save(f"{out_dir}/tokenizer.json")
    spec = json.load(open(f"{out_dir}/tokenizer.json"))
    vocab = tok.get_vocab(with_added_tokens=True)
    by_id = {i: t for t, i in vocab.items()}
    added = {a["id"]: a for a in spec["added_tokens"]}
    tokens, types = [], []
    for i in range(max(by_id) + 1):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if i in added and added[i]["special"] else gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    w = gguf.GGUFWriter(f"{out_dir}/tokenizer.gguf", "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    expected = [[s, tok.encode(s, add_special_tokens=False).ids] for s in SAMPLES]
    json.dump(expected, open(f"{out_dir}/expected.json", "w"), ensure_ascii=False)


def hf_checkpoint(hf_dir):
    cfg = json.load(open(f"{hf_dir}/config.json"))
    return cfg, load_file(f"{hf_dir}/model.safetensors")


def permute(w, n_head):
    """convert_hf_to_gguf.py's LlamaModel.permute (q: heads, k: kv heads)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def converted(cfg, tensors):
    """{gguf name: float32 array} as the converter writes them."""
    arch = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen3": gguf.MODEL_ARCH.QWEN3}[cfg["model_type"]]
    tmap = gguf.get_tensor_name_map(arch, cfg["num_hidden_layers"])
    out = {}
    for name, w in tensors.items():
        if cfg["model_type"] == "llama":
            if name.endswith(("q_proj.weight", "q_proj.bias")):
                w = permute(w, cfg["num_attention_heads"])
            elif name.endswith(("k_proj.weight", "k_proj.bias")):
                w = permute(w, cfg["num_key_value_heads"])
        new = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        out[new] = w.astype(np.float32)
    return out


def convert(hf_dir, out):
    cfg, tensors = hf_checkpoint(hf_dir)
    arch = cfg["model_type"]
    w = gguf.GGUFWriter(out, arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    theta = cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(0)
    w.add_tokenizer_model("none")
    for name, a in converted(cfg, tensors).items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def check_model(path, hf_dir):
    cfg, tensors = hf_checkpoint(hf_dir)
    want = converted(cfg, tensors)
    r = gguf.GGUFReader(path)
    got = {t.name: t for t in r.tensors}
    assert set(got) == set(want), (sorted(set(got) ^ set(want)))
    for name, a in want.items():
        t = got[name]
        assert t.tensor_type == T.F32, (name, t.tensor_type)
        assert list(t.shape) == list(reversed(a.shape)), (name, list(t.shape), a.shape)
        assert np.array_equal(np.asarray(t.data).reshape(a.shape), a), f"{name}: values differ"
    arch = cfg["model_type"]
    f = lambda k: r.fields[k].contents()  # noqa: E731
    assert f("general.architecture") == arch
    assert f(f"{arch}.block_count") == cfg["num_hidden_layers"]
    assert f(f"{arch}.attention.head_count_kv") == cfg["num_key_value_heads"]
    assert f(f"{arch}.feed_forward_length") == cfg["intermediate_size"]
    print("ok")


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif sys.argv[1] == "convert":
        convert(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "tokenizer":
        tokenizer(sys.argv[2], sys.argv[3], sys.argv[4])
    elif sys.argv[1] == "check-model":
        check_model(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "check":
        check(sys.argv[2], sys.argv[3])
    else:
        sys.exit(f"unknown command {sys.argv[1]}")
