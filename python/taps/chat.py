"""The one chat template of the project, used for training text and evaluation prompts alike.

A conversation is a list of ``{"role": ..., "content": ...}`` messages with role ``system`` (optional,
first only), ``user`` or ``assistant``. It is rendered as::

    <|bos|><|system|>\\n{system}<|end|>\\n<|user|>\\n{question}<|end|>\\n<|assistant|>\\n{answer}<|end|>\\n

and a generation prompt ends with ``<|assistant|>\\n``. ``<|end|>`` is the tokenizer's eos token, so
generation stops at the end of the assistant turn. The same template is stored as a Jinja
``chat_template`` in the saved tokenizer, so ``tokenizer.apply_chat_template`` gives the same string as
:func:`render` (a test checks it).
"""

from __future__ import annotations

import re
from typing import Iterable, List, Mapping, Sequence

BOS = "<|bos|>"
END = "<|end|>"
PAD = "<|pad|>"
ROLES = ("system", "user", "assistant")
ROLE_TOKENS = {r: f"<|{r}|>" for r in ROLES}
# Order fixes the ids: <|bos|> = 0, <|end|> = 1, <|pad|> = 2, then the role markers.
SPECIAL_TOKENS = [BOS, END, PAD] + [ROLE_TOKENS[r] for r in ROLES]

# Jinja form of render(), stored in the tokenizer (tokenizer_config.json / chat_template.jinja).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown chat role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


class ChatFormatError(ValueError):
    """A conversation that the chat template cannot represent."""


def validate_messages(messages: Sequence[Mapping], *, allow_trailing_user: bool = True) -> None:
    """Raise ChatFormatError unless ``messages`` is a well-formed conversation: an optional system
    message first, then user and assistant turns alternating, starting with the user; non-empty string
    contents that contain none of the template's special tokens."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatFormatError("a conversation must be a non-empty list of messages")
    expect = "user"
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise ChatFormatError(f"message {i} must be a mapping with 'role' and 'content', got {m!r:.80}")
        role, content = m["role"], m["content"]
        if role not in ROLES:
            raise ChatFormatError(f"message {i}: unknown role {role!r} (expected one of {ROLES})")
        if not isinstance(content, str) or not content.strip():
            raise ChatFormatError(f"message {i} ({role}): content must be a non-empty string")
        for tok in SPECIAL_TOKENS:
            if tok in content:
                raise ChatFormatError(f"message {i} ({role}): content contains the special token {tok!r}")
        if role == "system":
            if i != 0:
                raise ChatFormatError(f"message {i}: a system message may only come first")
            continue
        if role != expect:
            raise ChatFormatError(f"message {i}: expected a {expect} turn, got {role} (turns must alternate, "
                                  "user first)")
        expect = "assistant" if role == "user" else "user"
    if messages[-1]["role"] == "system":
        raise ChatFormatError("a conversation needs at least one user turn after the system message")
    if not allow_trailing_user and messages[-1]["role"] != "assistant":
        raise ChatFormatError("the conversation must end with an assistant turn")


def render(messages: Sequence[Mapping], add_generation_prompt: bool = False, *, validate: bool = True) -> str:
    """The conversation as text in the chat template (with the special-token strings)."""
    if validate:
        validate_messages(messages)
    parts = [BOS]
    for m in messages:
        parts.append(f"{ROLE_TOKENS[m['role']]}\n{m['content']}{END}\n")
    if add_generation_prompt:
        parts.append(f"{ROLE_TOKENS['assistant']}\n")
    return "".join(parts)


_TURN = re.compile(r"<\|(system|user|assistant)\|>\n(.*?)<\|end\|>\n", re.S)


def parse(text: str) -> List[dict]:
    """Inverse of :func:`render` (without a generation prompt): the messages of a rendered conversation."""
    if not text.startswith(BOS):
        raise ChatFormatError(f"rendered conversation must start with {BOS}")
    pos, out = len(BOS), []
    while pos < len(text):
        m = _TURN.match(text, pos)
        if m is None:
            raise ChatFormatError(f"cannot parse a chat turn at offset {pos}: {text[pos:pos + 40]!r}")
        out.append({"role": m.group(1), "content": m.group(2)})
        pos = m.end()
    return out


class ChatTokenizer:
    """The tokenizer wrapper: a Hugging Face fast tokenizer plus the chat template.

    ``encode_chat(messages)`` gives token ids of the rendered conversation; ``decode`` keeps the special
    tokens so ``parse(decode(encode_chat(m))) == m``. It also answers what code written for a Hugging Face
    tokenizer asks of one (``SpeculativeDecoder(..., tokenizer=tok)`` takes it or ``tok.hf`` alike): it is
    callable (``tok(text)["input_ids"]``), has ``eos_token_id`` / ``bos_token_id`` / ``pad_token_id``,
    ``len()``, ``get_vocab()`` and ``apply_chat_template``.
    """

    def __init__(self, hf_tokenizer):
        self.hf = hf_tokenizer
        for tok in SPECIAL_TOKENS:
            if self.hf.convert_tokens_to_ids(tok) is None:
                raise ValueError(f"tokenizer lacks the special token {tok}")
        self.bos_id = self.hf.convert_tokens_to_ids(BOS)
        self.eos_id = self.hf.convert_tokens_to_ids(END)
        self.pad_id = self.hf.convert_tokens_to_ids(PAD)

    @classmethod
    def from_pretrained(cls, path) -> "ChatTokenizer":
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(path)))

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    # --- the Hugging Face tokenizer's names
    @property
    def eos_token_id(self) -> int:
        return self.eos_id

    @property
    def bos_token_id(self) -> int:
        return self.bos_id

    @property
    def pad_token_id(self) -> int:
        return self.pad_id

    def __len__(self) -> int:
        return len(self.hf)

    def get_vocab(self) -> dict:
        return self.hf.get_vocab()

    def __call__(self, *args, **kwargs):
        """The Hugging Face tokenizer's call (``tok(text)["input_ids"]``)."""
        return self.hf(*args, **kwargs)

    def apply_chat_template(self, messages, add_generation_prompt: bool = False, tokenize: bool = True):
        """As Hugging Face's: the conversation's token ids (``tokenize=False``: its text) in the chat template."""
        if tokenize:
            return self.encode_chat(messages, add_generation_prompt)
        return self.render(messages, add_generation_prompt)

    def render(self, messages, add_generation_prompt: bool = False) -> str:
        return render(messages, add_generation_prompt)

    def encode_text(self, text: str) -> List[int]:
        return self.hf(text, add_special_tokens=False)["input_ids"]

    def encode_chat(self, messages, add_generation_prompt: bool = False) -> List[int]:
        return self.encode_text(render(messages, add_generation_prompt))

    def encode_chats(self, conversations: Iterable[Sequence[Mapping]], batch_size: int = 512) -> List[List[int]]:
        """Token ids of many conversations (batched through the fast tokenizer)."""
        out: List[List[int]] = []
        batch: List[str] = []
        for conv in conversations:
            batch.append(render(conv))
            if len(batch) == batch_size:
                out.extend(self.hf(batch, add_special_tokens=False)["input_ids"])
                batch = []
        if batch:
            out.extend(self.hf(batch, add_special_tokens=False)["input_ids"])
        return out

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        # the fast tokenizer's own decode: what hf.decode returns without clean-up, with none of its argument
        # handling (2.6 -> 0.7 us for a few tokens; a server decodes twice per generated token)
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is not None:
            return backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens,
                              clean_up_tokenization_spaces=False)
