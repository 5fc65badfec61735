#!/usr/bin/env python3
"""Runs llama.cpp's own `convert_hf_to_gguf.py` on a checkpoint that has no
tokenizer files (the fixtures: byte ids, no tokenizer.json), for
`benches/compare_gguf_logits.py`.

The converter's tensor handling is used as is (names, q/k permutation,
`--outtype`); only its vocabulary step is replaced, by what llama.cpp's
writer takes for a model fed token ids: `tokenizer.ggml.model = "none"` and
the vocabulary size.

Usage (a python with torch, e.g. scripts/setup-transformers-venv's):
    python benches/llama_cpp_convert.py LLAMA_CPP_DIR HF_DIR OUT.gguf OUTTYPE
"""
import sys


def main():
    src, hf_dir, out, outtype = sys.argv[1:5]
    sys.path.insert(0, src)
    import convert_hf_to_gguf
    from conversion.base import TextModel

    def no_vocab(self, *args, **kwargs):
        self.gguf_writer.add_tokenizer_model("none")
        self.gguf_writer.add_vocab_size(self.hparams["vocab_size"])

    # Every model class's set_vocab goes through one of these helpers.
    for name in dir(TextModel):
        if name.startswith("_set_vocab_"):
            setattr(TextModel, name, no_vocab)
    sys.argv = ["convert_hf_to_gguf.py", hf_dir, "--outfile", out, "--outtype", outtype]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
