import json

from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy.models.tokenizer import EOS_TOKEN, PAD_TOKEN, VOCAB_SIZE, _tokenizer_json, build_tokenizer
from offpolicy.tasks import ArithmeticTask, CountdownTask

TOK = build_tokenizer()


def test_vocabulary_is_large_with_distinct_specials():
    assert len(TOK) >= 4096 and len(TOK) == VOCAB_SIZE
    ids = {TOK.pad_token_id, TOK.bos_token_id, TOK.eos_token_id}
    assert len(ids) == 3 and TOK.pad_token == PAD_TOKEN and TOK.eos_token == EOS_TOKEN
    assert TOK.padding_side == "left"


def test_task_text_roundtrips_and_digits_are_single_tokens():
    examples = ArithmeticTask(max_digits=4).examples(50, 0) + CountdownTask(n_numbers=4).examples(50, 0)
    for ex in examples:
        for text in (ex.prompt, ex.answer, ex.prompt + ex.answer):
            ids = TOK(text)["input_ids"]
            assert ids[0] == TOK.bos_token_id  # bos is added by the post-processor
            assert TOK.decode(ids, skip_special_tokens=True) == text
    pieces = TOK.convert_ids_to_tokens(TOK("1234+56=", add_special_tokens=False)["input_ids"])
    assert pieces == ["1", "2", "3", "4", "+", "5", "6", "="]


@settings(max_examples=50, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40))
def test_any_text_roundtrips(text):
    """Byte-level BPE: every string survives encode → decode unchanged."""
    ids = TOK(text, add_special_tokens=False)["input_ids"]
    assert TOK.decode(ids) == text


def test_deterministic_build():
    fresh = _tokenizer_json.__wrapped__(0)  # bypass the per-process cache: a real second training run
    assert fresh == _tokenizer_json(0)
    assert len(json.loads(fresh)["model"]["vocab"]) == VOCAB_SIZE


def test_save_and_load_with_auto_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    TOK.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "Use 3 5 7 to make 22: 3*5+7"
    assert loaded(text)["input_ids"] == TOK(text)["input_ids"]
    assert (loaded.pad_token_id, loaded.eos_token_id, len(loaded)) == (TOK.pad_token_id, TOK.eos_token_id, len(TOK))
