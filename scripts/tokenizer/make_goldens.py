#!/usr/bin/python3
"""Step 1 of the goldens: builds the tokenizer golden corpus: tests/data/tokenizer/corpus.jsonl.gz.

One JSON object per line: {"cat": category, "text": string[, "src": where the text came from]}.
Deterministic (random.Random(20261130)) given the same Debian 12 files. Categories:
prose, code_*, lang_*, emoji, nfc, digits, whitespace, contractions, special,
random_*, doc (20 documents of >= 50 KB copied from Debian files, each with its source path).

Random strings use only code points assigned in Unicode 14 (Python 3.11's unicodedata is
14.0.0; PCRE2 10.42 in Debian 12 knows Unicode 14), so that \\p{L}/\\p{M}/\\p{N} agree between
PCRE2 and the reference (HF tokenizers, Oniguruma). Run: /usr/bin/python3 scripts/tokenizer/make_goldens.py; step 2 (HF ids) is hf_goldens.py.
"""
import glob
import gettext
import gzip
import json
import os
import random
import re
import sys
import unicodedata

OUT = os.path.join(os.path.dirname(__file__), "../../tests/data/tokenizer/corpus.jsonl.gz")
rng = random.Random(20261130)
records = []


def add(cat, text, src=None):
    r = {"cat": cat, "text": text}
    if src:
        r["src"] = src
    records.append(r)


def read_text(path):
    if path.endswith(".gz"):
        with gzip.open(path, "rb") as f:
            data = f.read()
    else:
        with open(path, "rb") as f:
            data = f.read()
    return data.decode("utf-8")


def paragraphs(text):
    return [p.strip("\n") for p in re.split(r"\n\s*\n", text) if p.strip()]


# ---- English prose: paragraphs of the Debian licence texts ----------------------------------
prose = []
for path in sorted(glob.glob("/usr/share/common-licenses/*")):
    if os.path.islink(path):
        continue
    for p in paragraphs(read_text(path)):
        if 40 <= len(p) <= 1500:
            prose.append((p, path))
rng.shuffle(prose)
for p, path in prose[:250]:
    add("prose", p, path)
for s in [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world", " Hello world", "Hello  world  ", "HELLO WORLD!!!", "hello\nworld\n",
    "It's 3:45 p.m. on Monday, 1 January 2024 -- isn't it?",
    "Mr. O'Neil said: \"Don't panic.\" (He meant it.)",
    "e.g., i.e., etc., vs. -- the usual abbreviations...",
    "Email me at someone@example.com or visit https://example.org/a/b?c=d&e=f#g.",
]:
    add("prose", s)

# ---- code --------------------------------------------------------------------------------------
def chunks_of(path, cat, n, max_lines=30):
    try:
        lines = read_text(path).split("\n")
    except (UnicodeDecodeError, OSError):
        return
    for _ in range(n):
        a = rng.randrange(0, max(1, len(lines) - 2))
        b = min(len(lines), a + rng.randint(1, max_lines))
        add(cat, "\n".join(lines[a:b]), path)


py_files = sorted(glob.glob("/usr/lib/python3.11/*.py"))
for path in rng.sample(py_files, 40):
    chunks_of(path, "code_python", 2)
cpp_files = sorted(glob.glob("/usr/include/c++/12/bits/*.h")) + sorted(glob.glob("/usr/include/c++/12/bits/*.tcc"))
for path in rng.sample(cpp_files, 40):
    chunks_of(path, "code_cpp", 2)
json_files = sorted(glob.glob("/usr/share/iso-codes/json/*.json")) + sorted(glob.glob("/usr/share/cmake-3.25/Help/manual/presets/*.json"))
for path in json_files:
    chunks_of(path, "code_json", 5, 15)
sh_files = [p for p in ["/usr/bin/gettextize", "/usr/bin/ucf", "/usr/bin/apt-key", "/usr/bin/dpkg-maintscript-helper", "/usr/bin/tzselect"] if os.path.exists(p)]
sh_files += sorted(glob.glob("/etc/init.d/*"))
for path in sh_files:
    chunks_of(path, "code_shell", 10, 20)
for s in ['{"a": 1, "b": [true, false, null], "c": {"d": "e\\u00e9"}}', "int main(){return 0;}",
          "def f(x):\n\treturn x**2\n", "for i in $(seq 1 10); do echo \"$i\"; done 2>&1 | tee log.txt",
          "    if (a != b && c <= d) { x += 1; } // comment\r\n", "#include <vector>\n#define X(a) #a\n"]:
    add("code_misc", s)

# ---- languages: translated messages from Debian .mo catalogues ---------------------------------
for lang, n in [("zh_CN", 60), ("ja", 60), ("ko", 60), ("ar", 50), ("he", 50), ("hi", 50), ("th", 50),
                ("ru", 20), ("de", 20), ("vi", 20), ("el", 20)]:
    msgs = []
    for mo in sorted(glob.glob(f"/usr/share/locale/{lang}/LC_MESSAGES/*.mo")):
        try:
            with open(mo, "rb") as f:
                t = gettext.GNUTranslations(f)
        except Exception:
            continue
        for k, v in t._catalog.items():
            if isinstance(v, str) and 8 <= len(v) <= 400 and v != (k if isinstance(k, str) else ""):
                msgs.append((v, mo))
    msgs.sort()
    rng.shuffle(msgs)
    for v, mo in msgs[:n]:
        add("lang_" + lang, v, mo)
for s in ["中文测试：你好，世界！", "日本語のテキスト、カタカナとひらがな。", "한국어 텍스트입니다.", "مرحبا بالعالم",
          "שלום עולם", "नमस्ते दुनिया", "สวัสดีชาวโลก", "Привет, мир!", "Tiếng Việt có dấu", "Ελληνικά κείμενα"]:
    add("lang_mixed", s)

# ---- emoji ---------------------------------------------------------------------------------------
base = ["😀", "😂", "🥲", "❤️", "👍", "🎉", "🚀", "🔥", "✨", "🤖", "🧠", "🍕", "☕", "⚡", "🌍", "🦀", "🐍", "🫠", "🥹"]
zwj = ["👨‍👩‍👧‍👦", "👩‍💻", "🏳️‍🌈", "🏴‍☠️", "👩🏽‍🚀", "🧑‍🤝‍🧑", "❤️‍🔥", "👁️‍🗨️", "🐻‍❄️", "🧔‍♀️", "👨🏿‍🦰"]
flags = ["🇺🇸", "🇯🇵", "🇩🇪", "🇫🇷", "🇨🇳", "🇧🇷", "🇮🇳", "🇺🇦", "🇪🇺", "🏴󠁧󠁢󠁳󠁣󠁴󠁿"]
tones = ["👍🏻", "👍🏼", "👍🏽", "👍🏾", "👍🏿", "👋🏽", "🤝🏾", "🙏🏿"]
allemoji = base + zwj + flags + tones
for e in allemoji:
    add("emoji", e)
for _ in range(110):
    parts = []
    for _ in range(rng.randint(1, 8)):
        parts.append(rng.choice(allemoji) if rng.random() < 0.6 else rng.choice(["hi", " ", "  ", "ok!", "\n", "测试", "x", "2024"]))
    add("emoji", "".join(parts))

# ---- combining marks and NFC/NFD pairs -----------------------------------------------------------
nfc_words = ["café", "naïve", "Ångström", "résumé", "Zürich", "São Paulo", "Tiếng Việt", "façade", "crème brûlée",
             "한국어", "가나다", "Ω", "Å", "ḍ̇", "ệ", "ǘ", "ﬁnal", "Ⅻ", "é̃", "q̣̇", "नक़्शा", "ক্ষ", "Σίσυφος",
             "x\u0301\u0323", "x\u0323\u0301", "\u212b", "\u2126", "\u1e9b\u0323", "ا\u0651\u064e", "e\u0300\u0301\u0302"]
for w in nfc_words:
    for form in ["NFC", "NFD", "NFKC"]:
        add("nfc", unicodedata.normalize(form, w))
    add("nfc", "The word " + unicodedata.normalize("NFD", w) + " in a sentence.")
    add("nfc", unicodedata.normalize("NFD", w) + unicodedata.normalize("NFC", w))
marks = [chr(c) for c in list(range(0x300, 0x370)) + list(range(0x1AB0, 0x1ACF)) + list(range(0x20D0, 0x20F1))
         if unicodedata.category(chr(c)) in ("Mn", "Me")]
for _ in range(50):
    s = "".join(rng.choice("aeiouAEIOUnsz 1") + "".join(rng.choice(marks) for _ in range(rng.randint(0, 4)))
                for _ in range(rng.randint(1, 10)))
    add("nfc", s)
for s in ["\u0301", " \u0301", "\u0301abc", "1\u0301", "!\u0301", "\n\u0301", "\u0903\u0930", "ñ" * 30, "n\u0303" * 30]:
    add("nfc", s)

# ---- digits --------------------------------------------------------------------------------------
for n in range(1, 41):
    add("digits", "".join(rng.choice("0123456789") for _ in range(n)))
for s in ["3.14159265358979", "1,000,000", "2024-01-01T12:34:56Z", "v1.2.3-rc4", "0x7fffffff", "1e-10",
          "١٢٣٤٥", "१२३", "一二三", "①②③", "Ⅷ", "¼½¾", "²³", "１２３", "𝟙𝟚𝟛", "abc123def456", "  42  ", "-17", "+3.0e+08"]:
    add("digits", s)
for _ in range(40):
    add("digits", " ".join(str(rng.randint(0, 10 ** rng.randint(1, 12))) for _ in range(rng.randint(1, 6))))

# ---- whitespace ------------------------------------------------------------------------------------
ws_atoms = [" ", "  ", "\t", "\n", "\r\n", "\n\n\n", "\r", "\u00a0", "\u3000", "\u2009", "\v", "\f", "\u2028", "\u0085"]
for s in ["", " ", "  ", "   ", "\t", "\n", "\r\n", "\n\n\n", "trailing   ", "   leading", "a \n b", "a\r\n\r\nb",
          "x\t\ty", "line1\nline2\n", "  \n  \n", " \t \n", "word \u00a0word", "end.\n\n\n\n"]:
    add("whitespace", s)
for _ in range(140):
    parts = []
    for _ in range(rng.randint(1, 10)):
        parts.append(rng.choice(ws_atoms) if rng.random() < 0.55 else rng.choice(["a", "Hello", "x1", "!", "中", "é", "'s", "--"]))
    add("whitespace", "".join(parts))

# ---- contractions in every case ----------------------------------------------------------------
conts = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d"]
def cases(c):
    letters = c[1:]
    out = set()
    for mask in range(1 << len(letters)):
        out.add("'" + "".join(ch.upper() if mask >> i & 1 else ch for i, ch in enumerate(letters)))
    return sorted(out)
for c in conts:
    for v in cases(c):
        for w in ["it", "IT", "we", "They", "I", "you", "x", ""]:
            add("contractions", w + v)
        add("contractions", "He said " + "it" + v + " fine, " + v + v + " ok")
for s in ["don't", "DON'T", "Don'T", "I'M", "we'Re", "y'all'd've", "rock'n'roll", "'", "''", "' s", "’s", "it’s"]:
    add("contractions", s)

# ---- special-token strings inside text ----------------------------------------------------------
specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|box_end|>", "<|vision_pad|>",
            "<|image_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
            "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
for sp in specials:
    for t in ["{}", " {}", "{} ", "a{}b", "hello {} world", "{}{}", "\n{}\n", "<{}>", "<|im_start{}", "x {}  y"]:
        add("special", t.format(sp, sp) if t.count("{}") == 2 else t.format(sp))
for s in ["<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n", "<|im_start|>assistant\n<think>\nhm\n</think>\n\nok<|im_end|>",
          "<|endoftext", "|endoftext|>", "<|IM_START|>", "< |im_start| >", "<<|im_end|>>"]:
    add("special", s)

# ---- random valid UTF-8 of every length 0..64 (code points assigned in Unicode 14) ---------------
assigned = [c for c in range(0x110000) if not (0xD800 <= c <= 0xDFFF) and unicodedata.category(chr(c)) != "Cn"]
def pool(lo, hi):
    return [c for c in range(lo, hi) if unicodedata.category(chr(c)) != "Cn"]
pools = [
    (4, [c for c in range(0x20, 0x7F)] + [9, 10, 13]),
    (2, pool(0xA0, 0x250)),
    (1, [ord(m) for m in marks]),
    (1, pool(0x4E00, 0x4F00) + pool(0x3040, 0x3100)),
    (1, pool(0xAC00, 0xAD00) + pool(0x1100, 0x1200)),
    (1, pool(0x1F300, 0x1FA00)),
    (1, pool(0x0590, 0x0700) + pool(0x0900, 0x0980) + pool(0x0E00, 0x0E80)),
    (1, pool(0x2000, 0x2C00)),
    (1, assigned),
]
weights = [w for w, _ in pools]
for length in range(0, 65):
    for k in range(16):
        if k < 4:
            s = "".join(chr(rng.choice(assigned)) for _ in range(length))
            add("random_uniform", s)
        else:
            s = "".join(chr(rng.choice(rng.choices(pools, weights)[0][1])) for _ in range(length))
            add("random_mixed", s)

# ---- documents of >= 50 KB copied from Debian files -----------------------------------------------
def man_text(lang):
    files = sorted(glob.glob(f"/usr/share/man/{lang}/man*/*.gz"))
    return files


def build_doc(paths, limit=51200, cap=65536):
    out, used, size = [], [], 0
    for p in paths:
        try:
            t = read_text(p)
        except (UnicodeDecodeError, OSError):
            continue
        used.append(p)
        for line in t.split("\n"):
            out.append(line)
            size += len(line.encode()) + 1
            if size >= limit:
                break
        if size >= limit:
            break
    text = "\n".join(out) + "\n"
    assert len(text.encode()) >= limit, (paths[:3], len(text.encode()))
    return text, ",".join(used)


docs = [
    ["/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/GPL-2"],
    ["/usr/share/common-licenses/LGPL-2.1", "/usr/share/common-licenses/LGPL-2"],
    ["/usr/share/common-licenses/GFDL-1.3", "/usr/share/common-licenses/Apache-2.0", "/usr/share/common-licenses/MPL-2.0", "/usr/share/common-licenses/LGPL-3"],
    ["/usr/share/man/man1/bash.1.gz"],
    ["/usr/share/man/man3/pcre2pattern.3.gz"],
    ["/usr/include/c++/12/bits/stl_algo.h"],
    ["/usr/include/c++/12/bits/regex.h"],
    ["/usr/lib/python3.11/argparse.py"],
    ["/usr/bin/gettextize", "/usr/bin/ucf", "/usr/bin/apt-key", "/usr/bin/dpkg-maintscript-helper", "/usr/bin/tzselect"],
    ["/usr/share/iso-codes/json/iso_639-3.json"],
]
for lang in ["de", "fr", "ja", "zh_CN", "ko", "ru", "es", "pl", "uk", "sv"]:
    docs.append(man_text(lang))
for paths in docs:
    text, src = build_doc(paths)
    add("doc", text, src)

os.makedirs(os.path.dirname(OUT), exist_ok=True)
with gzip.GzipFile(OUT, "wb", mtime=0) as f:
    for r in records:
        f.write((json.dumps(r, ensure_ascii=False) + "\n").encode())
cats = {}
for r in records:
    cats[r["cat"]] = cats.get(r["cat"], 0) + 1
print(len(records), "strings;", sum(len(r["text"].encode()) for r in records), "bytes;", cats, file=sys.stderr)
