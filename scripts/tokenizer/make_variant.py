#!/usr/bin/python3
"""Writes the Qwen3.8-style test tokenizer.json: the Qwen3 file with its Split regex replaced by
docs/model.md §A.5's (\\p{M} inside letter runs). Vocabulary, merges and added tokens are unchanged.
The C++ tests build the same file in-process (tests/test_tokenizer_golden.cpp).
Usage: make_variant.py QWEN3_TOKENIZER_JSON OUT_JSON
"""
import json
import sys

QWEN38_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def main():
    src, dst = sys.argv[1], sys.argv[2]
    with open(src, encoding="utf-8") as f:
        tok = json.load(f)
    split = tok["pre_tokenizer"]["pretokenizers"][0]
    assert split["type"] == "Split" and "Regex" in split["pattern"], split
    split["pattern"]["Regex"] = QWEN38_REGEX
    with open(dst, "w", encoding="utf-8") as f:
        json.dump(tok, f, ensure_ascii=False)


if __name__ == "__main__":
    main()
