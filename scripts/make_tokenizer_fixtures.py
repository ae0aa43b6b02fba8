#!/usr/bin/env python3
"""Writes tests/fixtures/tokenizers/: small tokenizer.json files of each family checkpoints ship, trained with
the `tokenizers` package on a small corpus, and that package's encodings and decodings of a varied text
corpus, which tests/test_tokenizer.cpp compares with exactly.

    pip install tokenizers && python3 scripts/make_tokenizer_fixtures.py

Families: qwen2 (NFC, the Qwen2 Split regex, ByteLevel, <|im_start|> ...), gpt2 (ByteLevel with its own
regex, as OLMoE / GPT-NeoX), deepseek_v3 (three Split regexes, BOS template), gpt_oss (the o200k regex,
ignore_merges), llama (Mixtral/Llama 2: Prepend + Replace normalizer, byte fallback, BOS template) and
metaspace (the Metaspace pre-tokenizer and decoder, prepend_scheme first, byte fallback)."""
import json
import os
import random

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "tokenizers")

QWEN2 = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"""
         r"""\s+(?!\S)|\s+""")
O200K = (r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"""
         r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"""
         r"""\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
DEEPSEEK = [r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
            r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|"""
            r"""\s*[\r\n]+|\s+(?!\S)|\s+"""]

TRAIN = [
    "The quick brown fox jumps over the lazy dog. It's what they'll say, isn't it? We've done it, I'm sure.",
    "def main(argv):\n    for i in range(10):\n        print(f\"value {i}: {argv[i]!r}\")\n    return 0\n",
    "int main() { std::vector<int> v{1, 2, 3}; return v.size() > 2 ? 0 : 1; }  // comment",
    "Numbers: 12345 3.14159 2026-11-30 1,000,000 and 0x7fff; prices $19.99, €5, ¥300.",
    "Café, naïve, résumé, Übergrößenträger, façade; Ελληνικά κείμενα; русский текст; עברית; العربية",
    "中文文本的分词测试。日本語のテキスト、カタカナとひらがな。한국어 텍스트입니다.",
    "Emoji: 😀 🎉 👍🏽 🇫🇷 ❤️ and symbols ∑ ∫ √ ≤ ≥ → ← ★ ☆ ♠ ♥",
    "   leading spaces, trailing spaces   \n\n\ttabs\tand\r\nwindows newlines\n  indented\n",
    "Mixture-of-Experts models route each token to a few experts; the router picks the top-k.",
    "HTTP/1.1 200 OK\nContent-Type: application/json\n\n{\"ids\": [1, 2, 3], \"text\": \"hello\"}",
] * 20

CORPUS = [
    "", " ", "  ", "\n", "Hello", "Hello world", " Hello world", "Hello  world", "hello\n\nworld\n",
    "The quick brown fox jumps over the lazy dog.",
    "It's THEY'RE we'VE I'M you'll he'd SHE'S ſ'S",
    "   three leading spaces and trailing   ",
    "tabs\tand\t\ttabs\r\nand CRLF\r\n\r\n",
    "a\u00a0b\u2003c\u3000d",
    "1 12 123 1234 12345 123456 3.14159 -42 1e10 ٣٤٥ ١٢ Ⅻ ½",
    "Café naïve résumé façade Übergrößenträger",
    "Cafe\u0301 nai\u0308ve e\u0301\u0323 \u1100\u1161\u11a8 A\u030a \u212b",
    "Ελληνικά κείμενα, русский текст, עברית, العربية",
    "中文文本的分词测试。日本語のテキスト、カタカナとひらがな。한국어 텍스트입니다.",
    "Emoji: 😀 🎉 👍🏽 🇫🇷 ❤️ 👨‍👩‍👧 and ∑ ∫ √ ≤ ≥ → ★",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    "for (int i = 0; i < n; ++i) { a[i] += b[i] * c; }",
    "{\"ids\": [1, 2, 3], \"text\": \"hi\"} <html><body>&amp;</body></html>",
    "path/to/file.txt and https://example.com/a?b=c&d=e#f",
    "!!!??? ... --- *** ### $$$ %%% ^^^ &&& ((( ))) [[[ ]]] {{{ }}}",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\nIt is 4.<|im_end|>",
    "<|endoftext|>Start<|endoftext|> middle <|endoftext|>",
    "<s>[INST] Hello there [/INST] Hi!</s>",
    "<s> <s>x</s></s>",
    "text with <unk> inside and <0x41> literal",
    "<｜begin▁of▁sentence｜>User: hi<｜end▁of▁sentence｜>",
    "<|start|>user<|message|>hello<|end|><|start|>assistant<|message|>hi<|return|>",
    "\u2581already\u2581has\u2581metaspace ▁▁ x",
    "Zero\u200bwidth\u200djoiner and control \x01\x02\x7f chars",
    "ᚠᛇᚻ ᛒᛦᚦ ᚠᚱᚩᚠᚢᚱ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝒰𝓃𝒾𝒸ℴ𝒹ℯ 𐐷𐐷",
    "MixedCASEWordsLikeThis and camelCaseToo and snake_case_words and SCREAMING_CASE",
    "  \n  \n\n   x   \n",
    "a" * 40 + " " + "ab" * 20 + " " + "😀" * 5,
]


def train(tok, vocab_size, special, alphabet=None, limit_alphabet=None):
    kw = {"vocab_size": vocab_size, "special_tokens": special, "show_progress": False}
    if alphabet is not None:
        kw["initial_alphabet"] = alphabet
    if limit_alphabet is not None:
        kw["limit_alphabet"] = limit_alphabet
    tok.train_from_iterator(TRAIN, trainers.BpeTrainer(**kw))
    return tok


def byte_level(pre, special, normalizer=None, vocab_size=700, post=None, ignore_merges=False):
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    train(tok, vocab_size, special, alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.post_processor = post if post is not None else processors.ByteLevel(trim_offsets=False)
    return tok


def byte_fallback_vocab(tok):
    """Llama's layout: <unk> <s> </s> at 0-2, <0x00>..<0xFF> at 3-258 (model vocabulary, not added), then BPE."""
    j = json.loads(tok.to_str())
    model = j["model"]
    old = model["vocab"]
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials)}
    for b in range(256):
        vocab["<0x%02X>" % b] = len(vocab)
    for t, _ in sorted(old.items(), key=lambda kv: kv[1]):
        if t not in vocab:
            vocab[t] = len(vocab)
    model["vocab"] = vocab
    model["byte_fallback"] = True
    model["fuse_unk"] = True
    model["unk_token"] = "<unk>"
    j["added_tokens"] = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, t in enumerate(specials)]
    return Tokenizer.from_str(json.dumps(j))


def llama(legacy):
    tok = Tokenizer(models.BPE())
    if legacy:  # Mixtral / Llama 2 as they ship
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        dec = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                 decoders.Strip(" ", 1, 0)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        dec = decoders.Sequence([decoders.Metaspace(replacement="▁", prepend_scheme="first"),
                                 decoders.ByteFallback(), decoders.Fuse()])
    if legacy:
        # Train on pre-split words so merges stay within words (as the sentencepiece originals do).
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    train(tok, 600, [], limit_alphabet=120)
    if legacy:
        tok.pre_tokenizer = None
    tok.decoder = dec
    tok = byte_fallback_vocab(tok)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    return tok


def families():
    qwen_special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    yield "qwen2", byte_level(
        pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2), "isolated", invert=False),
                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
        qwen_special, normalizer=normalizers.NFC())
    yield "gpt2", byte_level(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
                             ["<|endoftext|>", "<|padding|>"])
    bos = "<｜begin▁of▁sentence｜>"
    yield "deepseek_v3", byte_level(
        pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(p), "isolated", invert=False) for p in DEEPSEEK] +
                                [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
        [bos, "<｜end▁of▁sentence｜>"],
        post=processors.TemplateProcessing(single=bos + " $A", pair=bos + " $A " + bos + " $B",
                                           special_tokens=[(bos, 0)]))
    yield "gpt_oss", byte_level(
        pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(O200K), "isolated", invert=False),
                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
        ["<|start|>", "<|message|>", "<|end|>", "<|return|>", "<|endoftext|>"], ignore_merges=True)
    yield "llama", llama(legacy=True)
    yield "metaspace", llama(legacy=False)


def main():
    os.makedirs(OUT, exist_ok=True)
    rng = random.Random(0)
    for name, tok in families():
        path = os.path.join(OUT, name + ".tokenizer.json")
        tok.save(path, pretty=False)
        tok = Tokenizer.from_file(path)
        n = tok.get_vocab_size(with_added_tokens=True)
        cases = []
        for text in CORPUS:
            ids = tok.encode(text).ids
            plain = tok.encode(text, add_special_tokens=False).ids
            cases.append({"text": text, "ids": ids, "ids_no_special": plain,
                          "decoded": tok.decode(ids, skip_special_tokens=False),
                          "decoded_skip_special": tok.decode(ids, skip_special_tokens=True)})
        decodes = []
        for _ in range(12):  # random id runs: byte pieces that need not form UTF-8
            ids = [rng.randrange(n) for _ in range(rng.randrange(1, 12))]
            decodes.append({"ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False),
                            "decoded_skip_special": tok.decode(ids, skip_special_tokens=True)})
        with open(os.path.join(OUT, name + ".cases.json"), "w") as f:
            json.dump({"tokenizer": name + ".tokenizer.json", "vocab_size": n, "cases": cases,
                       "decodes": decodes}, f, ensure_ascii=False, indent=0)
            f.write("\n")
        print("%-12s vocab %4d, %d cases" % (name, n, len(cases)))


if __name__ == "__main__":
    main()
