"""The tiny test/demo tokenizer: vocabulary, special tokens, digits, and transformers loading it."""

import pytest

from ac2_jax.text.tiny_tokenizer import (
    TINY_CHAT_TEMPLATE,
    TINY_SPECIAL_TOKENS,
    TINY_TOOL_TOKENS,
    build_tiny_tokenizer,
    tiny_corpus,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tok"))
    return path, build_tiny_tokenizer(path)


def test_tiny_vocab_and_special_ids(tiny):
    _, tok = tiny
    assert 512 <= tok.vocab_size <= 1024
    for t in ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>",
              "<tool_response>", "</tool_response>"]:
        tid = tok.token_to_id(t)
        assert tid is not None and tok.encode(t) == [tid], t
    assert tok.eos_token_id == tok.token_to_id("<|im_end|>")
    assert tok.pad_token_id == tok.token_to_id("<|endoftext|>")
    assert set(tok.stop_token_ids) == {tok.eos_token_id, tok.pad_token_id}


def test_saved_dir_loads_with_the_template_and_hermes_parser(tiny):
    path, tok = tiny
    assert tok.chat_template == TINY_CHAT_TEMPLATE and tok.tool_parser.name == "hermes"
    assert set(TINY_SPECIAL_TOKENS) | set(TINY_TOOL_TOKENS) <= set(
        t.content for t in tok.hf.get_added_tokens_decoder().values())


def test_corpus_is_deterministic_and_seeded():
    a, b = tiny_corpus(90, seed=0), tiny_corpus(90, seed=0)
    assert a == b and len(a) == 94  # 3 kinds x 30 lines + 4 fixed lines
    assert tiny_corpus(90, seed=1) != a
    assert sum("<tool_call>" in line for line in a) >= 30


def test_individual_digits_option_matches_autotokenizer(tmp_path):
    from transformers import AutoTokenizer

    tok = build_tiny_tokenizer(str(tmp_path / "digits"), individual_digits=True)
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "digits"))
    text = "What is 47*38+12? The answer is 1798."
    ids = tok.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False)
    digits = [tok.id_to_token(i) for i in ids if tok.id_to_token(i).lstrip("Ġ").isdigit()]
    assert all(len(d.lstrip("Ġ")) == 1 for d in digits) and len(digits) == 10


def test_digit_group_makes_every_chunk_one_token_and_matches_autotokenizer(tmp_path):
    from transformers import AutoTokenizer

    tok = build_tiny_tokenizer(str(tmp_path / "d3"), vocab_size=640, digit_group=3)
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "d3"))
    for n in (0, 7, 42, 100, 549, 999):
        assert len(tok.encode(str(n))) == 1, n
    assert len(tok.encode("007")) == 1
    text = "Start at 549. Apply +37, 3 times. Then 1016 and 1234567."
    ids = tok.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    # Runs of digits split left to right into chunks of up to three (as cl100k does).
    numbers = [tok.decode([i]) for i in ids if tok.decode([i]).strip().isdigit()]
    assert numbers == ["549", "37", "3", "101", "6", "123", "456", "7"]


def test_digit_group_rejects_bad_values(tmp_path):
    with pytest.raises(ValueError, match="not both"):
        build_tiny_tokenizer(str(tmp_path / "x"), individual_digits=True, digit_group=3)
    with pytest.raises(ValueError, match="digit_group must be"):
        build_tiny_tokenizer(str(tmp_path / "y"), digit_group=4)
