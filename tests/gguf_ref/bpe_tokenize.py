"""A byte-level BPE tokenizer written from a GGUF file's vocabulary and merges, in plain
Python: independent of the Rust `tokenizers` crate arbor uses, for tests/smollm2.rs.

It follows GPT-2's algorithm (bytes mapped to printable characters, the pre-tokenizer's
regex, then the lowest-ranked merge first until none applies) with llama.cpp's pre-tokenizer
regexes for the `tokenizer.ggml.pre` values it handles, and splits the special (control and
user-defined) tokens out of the text first, longest first, as transformers does.

usage: bpe_tokenize.py MODEL.gguf IN.jsonl OUT.jsonl
IN: {"id": N, "prompt": "text"} per line; OUT: {"id": N, "tokens": [...]}.
"""
import json
import sys

import regex
from gguf import GGUFReader

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# llama.cpp's llama-vocab.cpp: the regexes applied in turn, each splitting the pieces the
# previous one left.
PRE = {
    "gpt-2": [GPT2],
    "smollm": [r"\p{N}", GPT2],
    "starcoder": [r"\p{N}", GPT2],
}


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def split_keep(pieces, pattern):
    """Splits every piece at the regex's matches, keeping matches and the text between."""
    out = []
    for p in pieces:
        pos = 0
        for m in regex.finditer(pattern, p):
            if m.start() > pos:
                out.append(p[pos:m.start()])
            out.append(m.group())
            pos = m.end()
        if pos < len(p):
            out.append(p[pos:])
    return [p for p in out if p]


class Bpe:
    def __init__(self, path):
        r = GGUFReader(path)
        f = lambda k: r.fields[k].contents()
        assert f("tokenizer.ggml.model") == "gpt2", f("tokenizer.ggml.model")
        self.pre = PRE[f("tokenizer.ggml.pre")]
        tokens = f("tokenizer.ggml.tokens")
        types = f("tokenizer.ggml.token_type")
        self.vocab = {}
        for i, t in enumerate(tokens):
            self.vocab.setdefault(t, i)
        self.ranks = {tuple(m.split(" ")): i for i, m in enumerate(f("tokenizer.ggml.merges"))}
        self.special = sorted((t for t, ty in zip(tokens, types) if ty in (3, 4)), key=len, reverse=True)
        self.byte_char = bytes_to_unicode()

    def word(self, piece):
        syms = [self.byte_char[b] for b in piece.encode("utf-8")]
        while len(syms) > 1:
            best = min(range(len(syms) - 1), key=lambda i: self.ranks.get((syms[i], syms[i + 1]), 1 << 62))
            pair = (syms[best], syms[best + 1])
            if pair not in self.ranks:
                break
            merged, i = [], 0
            while i < len(syms):
                if i < len(syms) - 1 and (syms[i], syms[i + 1]) == pair:
                    merged.append(syms[i] + syms[i + 1])
                    i += 2
                else:
                    merged.append(syms[i])
                    i += 1
            syms = merged
        return [self.vocab[s] for s in syms]

    def encode(self, text):
        ids = []
        i, plain = 0, ""
        while i <= len(text):
            sp = next((s for s in self.special if text.startswith(s, i)), None) if i < len(text) else None
            if sp is None and i < len(text):
                plain += text[i]
                i += 1
                continue
            pieces = [plain] if plain else []
            for pattern in self.pre:
                pieces = split_keep(pieces, pattern)
            for p in pieces:
                ids += self.word(p)
            plain = ""
            if sp is None:
                break
            ids.append(self.vocab[sp])
            i += len(sp)
        return ids


bpe = Bpe(sys.argv[1])
with open(sys.argv[2]) as fi, open(sys.argv[3], "w") as fo:
    for line in fi:
        if line.strip():
            req = json.loads(line)
            fo.write(json.dumps({"id": req["id"], "tokens": bpe.encode(req["prompt"])}) + "\n")
