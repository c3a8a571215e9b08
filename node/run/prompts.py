"""The one prompt builder: a task's prompt text, as the run's model is given it, in token ids.

The prompt's token ids are what the assignment, the proofs and the validator's `prompts` check bind, so
every party builds them here (through RunTasks), from the same inputs, the same way:

- **raw** (a checkpoint without a chat template, such as the default tiny model): the task's prompt, then
  the length-target instruction when the sample has a target, tokenized without special tokens. This is
  the format of every release before chat models, byte for byte.
- **chat** (the tokenizer config carries a chat template): the conversation [system prompt, if the run sets
  one] + [user: the same text as raw] rendered by the checkpoint's own template with the generation prompt
  (an open assistant turn), then tokenized without adding special tokens (the template writes its own).
  Rendering is chat_template.py's: deterministic and bounded.

`prompt_format` names the format: "sha256:<hex>" of (format version, mode, template text, system prompt,
length instruction). Rollout rows carry it, so a file made with another template or system prompt is
rejected naming that, not only as a prompt-token mismatch.

A system prompt without a chat template is refused: the raw format has no place for one, and inventing a
place would change prompts for models that were never trained on it. `check` renders probe prompts when
the run's task rules are loaded, so a template that fails, loops, ignores the generation prompt, drops the
user's text or renders differently each time stops the node or validator at start-up, naming the checkpoint.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from ...p2p.signing import canonical_json
from ..environments.length import THINKING_SUFFIX_TEMPLATE, thinking_suffix
from ..errors import PromptError
from .chat_template import ChatTemplate

if TYPE_CHECKING:  # transformers loads only with a model: the settings import this module
    from transformers import PreTrainedTokenizerBase

PROMPT_FORMAT_VERSION = "prime-node/prompt-format/v1"
MAX_SYSTEM_PROMPT_CHARS = 8192


def chat_template_of(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The tokenizer's chat template (tokenizer_config.json or chat_template.jinja), None without one; of
    several named templates, the `default` one, as transformers picks it for a conversation without tools."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        if "default" not in template:
            raise PromptError(
                f"the checkpoint has chat templates {sorted(template)} but none named 'default'"
            )
        template = template["default"]
    return template if template else None


def prompt_format_id(mode: str, template: str, system_prompt: str) -> str:
    """The format's name: "sha256:<hex>" of everything that shapes a prompt besides the task and the tokenizer."""
    document = {
        "version": PROMPT_FORMAT_VERSION,
        "mode": mode,
        "template": template,
        "system_prompt": system_prompt,
        "length_instruction": THINKING_SUFFIX_TEMPLATE,
    }
    return "sha256:" + hashlib.sha256(canonical_json(document)).hexdigest()


class PromptBuilder:
    """Prompt text and ids for one tokenizer (hence one checkpoint) and one system prompt."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, *, system_prompt: str = "") -> None:
        self.tokenizer = tokenizer
        self.source = str(getattr(tokenizer, "name_or_path", "") or "the checkpoint")
        if len(system_prompt) > MAX_SYSTEM_PROMPT_CHARS:
            raise PromptError(
                f"the system prompt has {len(system_prompt):,} characters; the bound is {MAX_SYSTEM_PROMPT_CHARS:,}"
            )
        self.system_prompt = system_prompt
        try:
            source = chat_template_of(tokenizer)
            self.template = ChatTemplate(source) if source is not None else None
        except PromptError as exc:
            raise PromptError(f"{self.source}: {exc}") from None
        self.mode: Literal["raw", "chat"] = "chat" if self.template is not None else "raw"
        if system_prompt and self.template is None:
            raise PromptError(
                f"the run sets a system prompt (run.system_prompt) but {self.source} has no chat template: "
                "a base model's prompts are the raw task text; leave run.system_prompt empty or use a chat model"
            )
        self.prompt_format = prompt_format_id(self.mode, source or "", system_prompt)
        # The template sees the special tokens by name ({{ bos_token }}), as apply_chat_template shows them.
        self._variables: dict[str, Any] = dict(tokenizer.special_tokens_map)

    def user_text(self, prompt: str, target: int | None = None) -> str:
        """The task's prompt with the length-target instruction: the whole raw prompt, or the user's turn."""
        return prompt + thinking_suffix(target) if target is not None else prompt

    def _messages(self, user: str) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": user}]

    def _render(self, user: str, add_generation_prompt: bool = True) -> str:
        assert self.template is not None
        try:
            return self.template.render(
                self._messages(user), add_generation_prompt=add_generation_prompt, variables=self._variables
            )
        except PromptError as exc:
            raise PromptError(f"{self.source}: {exc}") from None

    def text(self, prompt: str, target: int | None = None) -> str:
        """The prompt as the model reads it, before tokenization."""
        user = self.user_text(prompt, target)
        return user if self.template is None else self._render(user)

    def ids(self, prompt: str, target: int | None = None) -> tuple[int, ...]:
        return tuple(self.tokenizer(self.text(prompt, target), add_special_tokens=False)["input_ids"])

    def check(self, prompts: Sequence[str], targets: Sequence[int]) -> None:
        """Render each probe prompt (a task's) without a target and with the longest one; PromptError at the
        first problem, so that a broken template stops its user at start-up, not in the middle of the run."""
        for prompt in prompts:
            for target in (None, max(targets)) if targets else (None,):
                text = self.text(prompt, target)
                if not self.ids(prompt, target):
                    raise PromptError(f"{self.source}: the prompt {text!r} has no tokens")
                if self.template is not None:
                    self._check_rendering(self.user_text(prompt, target), text)

    def _check_rendering(self, user: str, text: str) -> None:
        problem = None
        if self._render(user) != text:
            problem = "renders the same conversation differently each time"
        elif user.strip() not in text:
            problem = "leaves the user's text out of the prompt"
        elif self.system_prompt.strip() not in text:
            problem = "leaves the system prompt out of the prompt"
        elif self._render(user, add_generation_prompt=False) == text:
            problem = "ignores add_generation_prompt (it opens no assistant turn for the model to answer in)"
        if problem:
            raise PromptError(f"{self.source}: the chat template {problem}")
