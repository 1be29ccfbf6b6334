"""Tokenizer wrapper, incremental detokenization and stop-string matching."""

from __future__ import annotations

import json

import pytest

from fastdraft.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer
from tests.helpers import write_tokenizer_files


@pytest.fixture(scope="module")
def tokenizer(llama_dir) -> Tokenizer:
    return Tokenizer(llama_dir)


# ----------------------------------------------------------------------------- stop strings


def _run(stop: list[str], pieces: list[str]) -> tuple[list[str], StopStringMatcher]:
    m = StopStringMatcher(stop)
    out = []
    for p in pieces:
        out.append(m.feed(p))
        if m.is_stopped:
            break
    return out, m


def test_stop_string_split_across_pieces():
    out, m = _run(["STOP"], ["Hello wor", "ld! ST", "O", "P and more"])
    assert out == ["Hello wor", "ld! ", "", ""]
    assert m.is_stopped and "".join(out) == "Hello world! "
    assert m.flush() == ""


def test_stop_string_inside_one_piece():
    out, m = _run(["\n\n"], ["abc\n\ndef"])
    assert out == ["abc"] and m.is_stopped


def test_held_back_prefix_is_emitted_by_flush():
    m = StopStringMatcher(["STOP"])
    assert m.feed("the end ST") == "the end "
    assert not m.is_stopped
    assert m.flush() == "ST"
    assert m.flush() == ""


def test_false_alarm_prefix_is_released_once_it_diverges():
    m = StopStringMatcher(["STOP"])
    assert m.feed("a ST") == "a "
    assert m.feed("AY") == "STAY"
    assert not m.is_stopped


def test_first_of_several_stop_strings_wins():
    out, m = _run(["world", "lo"], ["hello world"])
    assert out == ["hel"] and m.is_stopped
    # Order in the list does not matter: the earliest position in the text wins.
    out, _ = _run(["lo", "world"], ["hello world"])
    assert out == ["hel"]
    # A longer pending prefix of one stop string is kept while a shorter one completes.
    out, m = _run(["abcd", "cx"], ["ab", "c", "x"])
    assert "".join(out) == "ab" and m.is_stopped


def test_repeated_characters_in_stop_string():
    out, m = _run(["aab"], ["xa", "a", "aab"])
    assert "".join(out) == "xaa" and m.is_stopped


def test_no_stop_strings_passes_through():
    m = StopStringMatcher([])
    assert m.feed("anything STOP") == "anything STOP" and not m.is_stopped and m.flush() == ""


# ----------------------------------------------------------------------------- detokenizer

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "héllo wörld — naïve café",
    "日本語のテキスト 😀👍🏽 emoji",
    "mixed ascii ✓ and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢  \t  spaces",
]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_concatenation_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    assert len(ids) > 5
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add(i) for i in ids]
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)  # never a split UTF-8 character


def test_multibyte_character_is_held_until_complete(tokenizer):
    # The tiny vocabulary has no merges for CJK or emoji: each character is 3-4 byte tokens.
    ids = tokenizer.encode("😀")
    assert len(ids) == 4
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.add(i) for i in ids] == ["", "", "", "😀"]


def test_special_tokens_are_skipped_when_decoding(tokenizer):
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tokenizer.token_to_id("<|im_start|>") and ids[-1] == tokenizer.token_to_id("<|im_end|>")
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(detok.add(i) for i in ids) == "user\nhi"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


# ----------------------------------------------------------------------------- Tokenizer


def test_tokenizer_round_trip_and_config(tokenizer):
    assert tokenizer.vocab_size == 320
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.bos_token == "<|endoftext|>"
    assert not tokenizer.add_bos_token
    ids = tokenizer.encode("the cat sat")
    assert tokenizer.decode(ids) == "the cat sat"
    assert tokenizer.encode("the cat sat", add_special_tokens=True) == ids  # add_bos_token is off


def test_add_bos_token(tmp_path, tiny_tokenizer):
    write_tokenizer_files(tiny_tokenizer, tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["add_bos_token"] = True
    cfg["bos_token"] = {"content": "<|endoftext|>", "special": True}  # the dict form
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer(tmp_path)
    bos = tok.token_to_id("<|endoftext|>")
    plain = tok.encode("hello", add_special_tokens=False)
    assert tok.encode("hello") == [bos, *plain]
    assert tok.encode("<|endoftext|>hello") == [bos, *plain]  # not doubled


def test_chat_template_renders(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    no_prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert no_prompt == "<|im_start|>user\nHi<|im_end|>\n"


def test_chat_template_errors(tmp_path, tiny_tokenizer, tokenizer):
    with pytest.raises(ValueError):
        tokenizer.apply_chat_template([{"role": "user"}])
    with pytest.raises(ValueError):
        tokenizer.apply_chat_template(["just a string"])
    tiny_tokenizer.save(str(tmp_path / "tokenizer.json"))  # no tokenizer_config.json
    bare = Tokenizer(tmp_path)
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "x"}])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{{ raise_exception('roles must alternate') }}"}))
    with pytest.raises(ValueError, match="roles must alternate"):
        Tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer(tmp_path)


def test_chat_template_kwargs_reach_the_template(llama_dir):
    # Qwen3's template closes an empty thinking block when enable_thinking is false.
    tokenizer = Tokenizer(llama_dir)  # its own: the template is replaced
    tokenizer.set_chat_template(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
    messages = [{"role": "user", "content": "Hi"}]
    thinking = tokenizer.apply_chat_template(messages)
    assert thinking.endswith("<|im_start|>assistant\n")
    plain = tokenizer.apply_chat_template(messages, chat_template_kwargs={"enable_thinking": False})
    assert plain == thinking + "<think>\n\n</think>\n\n"
    assert tokenizer.encode_chat(messages, {"enable_thinking": False}) == tokenizer.encode(plain, add_special_tokens=False)
    with pytest.raises(ValueError, match="may not set messages"):
        tokenizer.apply_chat_template(messages, chat_template_kwargs={"messages": []})
