"""The shipped tokenizer wrapper (taps.chat.ChatTokenizer) answers what SpeculativeDecoder and code
written for a Hugging Face tokenizer ask of one, so the wrapper and its ``.hf`` tokenizer are
interchangeable there."""

import pytest

from taps import SpeculativeDecoder, models

pytestmark = pytest.mark.usefixtures("one_thread")

MESSAGES = [{"role": "user", "content": "What is 17 * 23?"}]


@pytest.fixture(scope="module")
def shipped():
    target, tok = models.load_target()
    return target, tok, models.load_drafter("hass", "math", target)


def test_hugging_face_names(shipped):
    _, tok, _ = shipped
    assert tok.eos_token_id == tok.eos_id == tok.hf.convert_tokens_to_ids("<|end|>")
    assert (tok.bos_token_id, tok.pad_token_id) == (tok.bos_id, tok.pad_id)
    assert len(tok) == len(tok.hf) and tok.get_vocab() == tok.hf.get_vocab()
    assert tok("17 * 23")["input_ids"] == tok.hf("17 * 23")["input_ids"] == tok.encode_text("17 * 23")
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert ids == tok.encode_chat(MESSAGES, add_generation_prompt=True)
    assert ids == tok.hf.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
    assert tok.apply_chat_template(MESSAGES, tokenize=False) == tok.render(MESSAGES)


def test_decoder_takes_the_wrapper_or_its_hf_tokenizer(shipped):
    target, tok, math = shipped
    text = tok.render(MESSAGES, add_generation_prompt=True)   # a text prompt, tokenized by the decoder
    outs = [SpeculativeDecoder(target, [math], tokenizer=t).generate([text], max_new_tokens=12,
                                                                    eos_token_id=tok.eos_token_id)
            for t in (tok, tok.hf)]
    assert outs[0].tokens == outs[1].tokens and len(outs[0].tokens[0]) > 0
    assert outs[0].text == outs[1].text == [tok.decode(outs[0].tokens[0])]


def test_decode_is_hugging_faces_without_clean_up(shipped):
    """ChatTokenizer.decode calls the fast tokenizer's backend directly (a server decodes twice per token):
    the text of Hugging Face's decode without clean-up, special tokens kept or skipped, for random ids
    (special tokens, partial multi-byte characters and single tokens included)."""
    import random

    _, tok, _ = shipped
    rng = random.Random(0)
    special = [tok.bos_id, tok.eos_id, tok.pad_id]
    for _ in range(300):
        ids = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(len(tok)) for _ in range(rng.randint(0, 12))]
        for skip in (False, True):
            assert tok.decode(ids, skip_special_tokens=skip) == tok.hf.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False), (ids, skip)
