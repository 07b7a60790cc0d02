"""A SentencePiece BPE vocabulary in a GGUF file, and the `sentencepiece` library's own
ids for some texts, for tests/gguf.rs: arbor's rebuilt tokenizer must encode as
SentencePiece itself does.

It trains a small BPE model the way Llama's was set up (byte fallback, digits split, a
dummy prefix, whitespace kept), writes its pieces, scores and types as llama.cpp's
convert_hf_to_gguf.py does (tokenizer.ggml.model "llama"), with the metadata of a one-layer
llama and no tensors, then encodes TEXTS with SentencePiece.

usage: spm_vocab.py WORK_DIR OUT.gguf TEXTS.json OUT.jsonl
TEXTS.json: a list of strings. OUT.jsonl: {"text", "ids" (with BOS), "decoded"} per text.
"""
import json
import os
import sys

import gguf
import sentencepiece as spm

work, out, texts_path, results = sys.argv[1:5]
os.makedirs(work, exist_ok=True)
words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "tokenizer", "piece",
         "sentence", "hello", "world", "Paris", "France", "capital", "naïve", "café", "über",
         "numbers", "like", "2024", "and", "3.14", "are", "split", "into", "digits", "code:",
         "fn", "main()", "{", "}", "x[0]", "=", "1;", "I'm", "can't", "they'll", "ünïcödé"]
lines = []
for i in range(3000):
    n = 4 + (i * 7) % 9
    lines.append(" ".join(words[(i * 13 + j * 5) % len(words)] for j in range(n)))
    if i % 10 == 0:
        lines.append("  indented   with  spaces\tand tabs")
corpus = os.path.join(work, "corpus.txt")
with open(corpus, "w") as f:
    f.write("\n".join(lines) + "\n")
prefix = os.path.join(work, "spm")
spm.SentencePieceTrainer.train(
    input=corpus, model_prefix=prefix, vocab_size=400, model_type="bpe", byte_fallback=True,
    split_digits=True, add_dummy_prefix=True, remove_extra_whitespaces=False,
    normalization_rule_name="identity", character_coverage=1.0, minloglevel=2,
    unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
)
sp = spm.SentencePieceProcessor(model_file=prefix + ".model")

tokens, scores, types = [], [], []
for i in range(sp.vocab_size()):
    tokens.append(sp.id_to_piece(i))
    scores.append(sp.get_score(i))
    if sp.is_unknown(i):
        types.append(gguf.TokenType.UNKNOWN)
    elif sp.is_control(i):
        types.append(gguf.TokenType.CONTROL)
    elif sp.is_unused(i):
        types.append(gguf.TokenType.UNUSED)
    elif sp.is_byte(i):
        types.append(gguf.TokenType.BYTE)
    else:
        types.append(gguf.TokenType.NORMAL)

w = gguf.GGUFWriter(out, "llama")
w.add_context_length(64)
w.add_embedding_length(16)
w.add_block_count(1)
w.add_feed_forward_length(32)
w.add_head_count(2)
w.add_head_count_kv(1)
w.add_layer_norm_rms_eps(1e-5)
w.add_vocab_size(len(tokens))
w.add_tokenizer_model("llama")
w.add_tokenizer_pre("default")
w.add_token_list(tokens)
w.add_token_scores(scores)
w.add_token_types(types)
w.add_unk_token_id(0)
w.add_bos_token_id(1)
w.add_eos_token_id(2)
w.add_add_bos_token(True)
w.add_add_eos_token(False)
w.add_add_space_prefix(True)
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()

with open(texts_path) as f:
    texts = json.load(f)
with open(results, "w") as f:
    for t in texts:
        ids = sp.encode(t, add_bos=True)
        f.write(json.dumps({"text": t, "ids": ids, "decoded": sp.decode(ids)}) + "\n")
