#!/usr/bin/env python3
"""Runs llama.cpp's own `convert_hf_to_gguf.py` on a checkpoint that has no
tokenizer files (the fixtures: byte ids, no tokenizer.json), for
`benches/compare_gguf_logits.py`.

The converter's tensor handling is used as is (names, q/k permutation,
`--outtype`); only its vocabulary step is replaced, by what llama.cpp's
writer takes for a model fed token ids: `tokenizer.ggml.model = "none"` and
the vocabulary size.

With --keep-vocab the checkpoint's tokenizer.json is converted as a GPT-2
style byte-level BPE instead.

Usage (a python with torch, e.g. scripts/setup-transformers-venv's):
    python benches/llama_cpp_convert.py LLAMA_CPP_DIR HF_DIR OUT.gguf OUTTYPE [--keep-vocab]
"""
import sys


def main():
    src, hf_dir, out, outtype = sys.argv[1:5]
    keep_vocab = "--keep-vocab" in sys.argv[5:]
    sys.path.insert(0, src)
    import convert_hf_to_gguf
    from conversion.base import TextModel

    def no_vocab(self, *args, **kwargs):
        self.gguf_writer.add_tokenizer_model("none")
        self.gguf_writer.add_vocab_size(self.hparams["vocab_size"])

    if keep_vocab:
        # The checkpoint's own tokenizer.json (a byte-level BPE, see
        # benches/compare_serve_peers.py), pre-tokenized as GPT-2 is: the
        # converter only knows pre-tokenizers by a hash of known tokenizers' outputs.
        TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"

        def not_this_kind(self, *args, **kwargs):
            raise FileNotFoundError("a byte-level BPE: not a SentencePiece or Llama HF vocabulary")

        # Llama's set_vocab tries these first and falls back to the GPT-2 helper.
        TextModel._set_vocab_sentencepiece = not_this_kind
        TextModel._set_vocab_llama_hf = not_this_kind
        gpt2 = TextModel._set_vocab_gpt2

        def gpt2_with_a_merge(self, *args, **kwargs):
            gpt2(self, *args, **kwargs)
            # llama.cpp refuses a BPE vocabulary without merges; a merge of
            # bytes 0 and 1 (never adjacent in text) changes no tokenization.
            self.gguf_writer.add_token_merges(["\u0100 \u0101"])

        TextModel._set_vocab_gpt2 = gpt2_with_a_merge
    else:
        # Every model class's set_vocab goes through one of these helpers.
        for name in dir(TextModel):
            if name.startswith("_set_vocab_"):
                setattr(TextModel, name, no_vocab)
    sys.argv = ["convert_hf_to_gguf.py", hf_dir, "--outfile", out, "--outtype", outtype]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
