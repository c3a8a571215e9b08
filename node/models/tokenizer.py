"""A character-level tokenizer that is a real transformers fast tokenizer.

It is a byte-level BPE with no merges: every byte is one token, so every ASCII character (all the task
family uses) is exactly one token, and any other text still encodes losslessly as its UTF-8 bytes. The
structure (split regex, byte-level pre-tokenizer and decoder, NFC) is the one transformers' Qwen2Tokenizer
rebuilds for a `qwen2` model, so the directory behaves identically whether it is loaded as that class
(AutoTokenizer does for model_type qwen2), straight from tokenizer.json, or by vLLM.
Three special tokens come first so their ids are stable: <pad>=0, <eos>=1, <unk>=2.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, UNK_TOKEN)
# The split regex of Qwen2's tokenizer; with no merges it only decides where byte-level words begin.
_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_symbols() -> list[str]:
    """The 256 printable symbols byte-level BPE uses for bytes 0..255 (GPT-2's bytes_to_unicode), in byte order."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    symbols: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def byte_level_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """Qwen2's split regex, then byte-level symbols: shared by this tokenizer and the chat model's BPE."""
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """The tokenizer, deterministic: ids 0-2 are the specials, then byte b has id 3 + b."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({symbol: len(SPECIAL_TOKENS) + b for b, symbol in enumerate(_byte_symbols())})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = byte_level_pre_tokenizer()
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
