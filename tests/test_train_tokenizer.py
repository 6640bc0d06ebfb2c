"""Chat template and tokenizer: render/parse round-trip, the Jinja template equals render(), a tiny
BPE trains, saves in Hugging Face format and loads with transformers, special tokens are single ids."""

import json

import pytest

from taps.chat import (BOS, END, SPECIAL_TOKENS, ChatFormatError, ChatTokenizer, parse, render,
                             validate_messages)
from taps.train.data import REPO_ROOT

CONV = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 12 * 3?\nShow work."},
        {"role": "assistant", "content": "12 * 3 = 36.\n#### 36"},
        {"role": "user", "content": "And   halved?"},
        {"role": "assistant", "content": "18 (ünïcödé, 中文, emoji 🙂)"}]

CORPUS = ["Hello there, how are you today? I am fine, thanks.",
          "Natalia sold 48 clips in April and half as many in May. 48/2 = 24. #### 72",
          "def add(a, b):\n    return a + b\n", "Let $x^2 = 4$, so $x = \\pm 2$ and $\\boxed{2}$."] * 30


def test_render_parse_round_trip():
    text = render(CONV)
    assert text.startswith(BOS + "<|system|>\n") and text.endswith(END + "\n")
    assert parse(text) == CONV
    assert render(CONV[1:2], add_generation_prompt=True).endswith("<|end|>\n<|assistant|>\n")


@pytest.mark.parametrize("bad", [
    [],
    [{"role": "assistant", "content": "hi"}],
    [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
    [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}],
    [{"role": "robot", "content": "a"}],
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": "a <|user|> b"}],
    [{"role": "user"}],
])
def test_invalid_conversations_rejected(bad):
    with pytest.raises(ChatFormatError):
        validate_messages(bad)


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    from taps.train.tokenizer import train_tokenizer

    out = tmp_path_factory.mktemp("tok")
    tok = train_tokenizer(CORPUS, out, vocab_size=400, eval_texts={"chat": CORPUS[:1], "math": CORPUS[1:2]})
    return out, tok


def test_tiny_tokenizer_trains_saves_and_loads_with_transformers(tiny_tokenizer):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    out, tok = tiny_tokenizer
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["vocab_size"] == len(tok.hf) <= 400
    assert set(manifest["files"]) >= {"tokenizer.json", "tokenizer_config.json"}
    for loader in (AutoTokenizer.from_pretrained, PreTrainedTokenizerFast.from_pretrained):
        hf = loader(str(out))
        assert hf.bos_token == "<|bos|>" and hf.eos_token == "<|end|>" and hf.pad_token == "<|pad|>"
        assert [hf.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
        assert hf.apply_chat_template(CONV, tokenize=False) == render(CONV)
        assert hf.apply_chat_template(CONV[:2], tokenize=False, add_generation_prompt=True) == \
            render(CONV[:2], add_generation_prompt=True)


def test_chat_tokens_round_trip(tiny_tokenizer):
    _, tok = tiny_tokenizer
    ids = tok.encode_chat(CONV)
    assert ids[0] == tok.bos_id and ids.count(tok.eos_id) == len(CONV)
    for t in SPECIAL_TOKENS[3:]:  # role markers are single tokens
        assert len(tok.encode_text(t)) == 1
    assert parse(tok.decode(ids)) == CONV
    # digits are split one per token
    digits = [tok.hf.convert_ids_to_tokens(i) for i in tok.encode_text("2024")]
    assert digits == ["2", "0", "2", "4"]


def test_shipped_tokenizer():
    folder = REPO_ROOT / "models" / "tokenizer"  # shipped in the repository: its absence is a failure
    from taps.train.tokenizer import file_hashes

    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["files"] == file_hashes(folder)
    tok = ChatTokenizer.from_pretrained(folder)
    assert tok.vocab_size == manifest["vocab_size"] == 8192
    assert parse(tok.decode(tok.encode_chat(CONV))) == CONV
