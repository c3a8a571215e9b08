"""The chat model's tokenizer: a byte-level BPE trained here, with a chat template and its control tokens.

Chat runs must be testable with a real instruct-style model although no model hub is reachable: a
tokenizer whose merges were learned (not the one-token-per-byte tokenizer of the default model) and whose
tokenizer_config.json carries a Jinja chat template, as an instruct model's does. It is trained with the
`tokenizers` library on the corpus of chat_corpus.py, which this project generates itself. Training is
deterministic: the alphabet is the 256 byte symbols in byte order, word counts are sums, and merge ties
are broken by token id, so the same corpus gives the same tokenizer.json bytes on every machine and in
every process (tests/test_model_init.py checks both).

The pre-tokenizer is the one of the default tokenizer (Qwen2's split regex, which keeps every digit a token
of its own, then byte-level), so arithmetic tokenizes digit by digit in both. Three control tokens come
first: `<|endoftext|>`=0 (padding), `<|im_start|>`=1 and `<|im_end|>`=2 (the end of a turn, hence the
model's EOS). The template wraps each message in them with its role name, and the generation prompt opens
an assistant turn; roles other than system, user and assistant are refused.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from .chat_corpus import corpus_lines
from .tokenizer import byte_level_pre_tokenizer

PAD_TOKEN = "<|endoftext|>"
TURN_START = "<|im_start|>"
TURN_END = "<|im_end|>"
CONTROL_TOKENS = (PAD_TOKEN, TURN_START, TURN_END)
VOCAB_SIZE = 1024  # the most tokens training may produce (control tokens and the 256 bytes included)
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('this chat template knows the roles system, user and assistant, not ' ~ message['role']) }}"
    "{%- endif -%}"
    "{{ '<|im_start|>' ~ message['role'] ~ '\\n' ~ message['content'] ~ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def train_chat_bpe() -> Tokenizer:
    """The raw `tokenizers` BPE, trained on the generated corpus (about a second on one core)."""
    core = Tokenizer(models.BPE(fuse_unk=False, byte_fallback=False))
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = byte_level_pre_tokenizer()
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(CONTROL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = list(corpus_lines())
    core.train_from_iterator(lines, trainer=trainer, length=len(lines))
    return core


def build_chat_tokenizer() -> PreTrainedTokenizerFast:
    """The tokenizer with its chat template; save it with save_model_dir (the template goes into
    tokenizer_config.json, where every transformers version and vLLM read it)."""
    return PreTrainedTokenizerFast(
        tokenizer_object=train_chat_bpe(),
        pad_token=PAD_TOKEN,
        eos_token=TURN_END,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
        chat_template=CHAT_TEMPLATE,
    )
