#!/usr/bin/env python3
"""Step 2 of the goldens (GPU machine, HF `tokenizers`): encodes every string of
corpus.jsonl.gz with tokenizers.Tokenizer.from_file for the Qwen3 tokenizer.json and the
Qwen3.8-style variant (make_variant.py), add_special_tokens=False, special tokens recognised.

Writes into OUT_DIR:
  goldens_qwen3.jsonl.gz, goldens_qwen38.jsonl.gz   one JSON id list per corpus line, in order
  goldens_qwen3_plain.jsonl.gz   {"i": line, "ids": [...]} for cat "special" with
                                 encode_special_tokens=True (special-token strings as text)
  goldens_decode.jsonl.gz        {"tok": name, "i": line, "dec": text} wherever
                                 decode(ids) differs from unicodedata NFC(text)
  goldens_meta.json              versions
Usage: hf_goldens.py CORPUS QWEN3_JSON QWEN38_JSON OUT_DIR
"""
import gzip
import json
import os
import sys
import unicodedata

import tokenizers
from tokenizers import Tokenizer


def main():
    corpus, q3, q38, out = sys.argv[1:5]
    with gzip.open(corpus, "rt", encoding="utf-8") as f:
        recs = [json.loads(l) for l in f]
    dec_out = []
    for name, path in [("qwen3", q3), ("qwen38", q38)]:
        tok = Tokenizer.from_file(path)
        with gzip.GzipFile(os.path.join(out, f"goldens_{name}.jsonl.gz"), "wb", mtime=0) as g:
            for i, r in enumerate(recs):
                ids = tok.encode(r["text"], add_special_tokens=False).ids
                g.write((json.dumps(ids, separators=(",", ":")) + "\n").encode())
                dec = tok.decode(ids, skip_special_tokens=False)
                if dec != unicodedata.normalize("NFC", r["text"]):
                    dec_out.append({"tok": name, "i": i, "dec": dec})
        if name == "qwen3":
            tok.encode_special_tokens = True
            assert tok.encode_special_tokens
            with gzip.GzipFile(os.path.join(out, "goldens_qwen3_plain.jsonl.gz"), "wb", mtime=0) as g:
                for i, r in enumerate(recs):
                    if r["cat"] == "special":
                        ids = tok.encode(r["text"], add_special_tokens=False).ids
                        g.write((json.dumps({"i": i, "ids": ids}, separators=(",", ":")) + "\n").encode())
    with gzip.GzipFile(os.path.join(out, "goldens_decode.jsonl.gz"), "wb", mtime=0) as g:
        for d in dec_out:
            g.write((json.dumps(d, ensure_ascii=False) + "\n").encode())
    meta = {"tokenizers": tokenizers.__version__, "python": sys.version,
            "unicodedata": unicodedata.unidata_version, "strings": len(recs)}
    with open(os.path.join(out, "goldens_meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(meta, len(dec_out), "decode differences")


if __name__ == "__main__":
    main()
