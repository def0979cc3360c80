"""Conversations and the trainer's two views of them: token-in/token-out keeps the engine's ids; re-tokenizing the
text drifts where a hand-built tokenizer merges across a boundary (offpolicy_testkit.toy_tokenizer)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from offpolicy_testkit.toy_tokenizer import ToyTokenizer

from offpolicy.models.tokenizer import build_tokenizer
from offpolicy.rollout.conversation import Conversation, Segment, render_turn, retokenize, trainer_view
from offpolicy.rollout.turn_drift import retokenization_drift, view_drift

TOK = ToyTokenizer()


def call_conversation(turn1_eos: bool) -> Conversation:
    """prompt "12*7=" | turn 1 "calc(12*7)" (+ eos) | tool "= 84" | turn 2 "84" eos, with μ = −0.1 × (position + 1)."""
    t = TOK.tokens
    turn1 = t("calc", "(", "1", "2", "*", "7", ")") + ((TOK.eos_token_id,) if turn1_eos else ())
    turn2 = t("8", "4") + (TOK.eos_token_id,)
    return Conversation((
        Segment("prompt", (TOK.bos_token_id, *t("1", "2", "*", "7", "=")), "12*7="),
        Segment("policy", turn1, render_turn(TOK, list(turn1))[1], tuple(-0.1 * (j + 1) for j in range(len(turn1)))),
        Segment("tool", tuple(TOK("= 84", add_special_tokens=False)["input_ids"]), "= 84"),
        Segment("policy", turn2, render_turn(TOK, list(turn2))[1], (-1.0, -2.0, -3.0)),
    ))


def test_the_engine_view_is_the_engines_ids_with_tool_tokens_out_of_the_loss():
    conv = call_conversation(turn1_eos=False)
    v = trainer_view(conv, "engine")
    assert v.prompt_ids == list(conv.segments[0].ids)
    assert v.completion_ids == [i for s in conv.segments[1:] for i in s.ids]
    # 7 turn-1 tokens, 2 tool tokens ("= 8", "4"), 3 turn-2 tokens
    assert v.loss == [True] * 7 + [False] * 2 + [True] * 3
    assert v.turn == [0] * 7 + [-1] * 2 + [1] * 3
    assert v.first == [True] + [False] * 8 + [True, False, False]
    assert v.rollout_logp == pytest.approx([-0.1 * (j + 1) for j in range(7)] + [0.0, 0.0, -1.0, -2.0, -3.0])
    report = view_drift([conv], [v])
    assert report.differing.tolist() == [[0, 0, 0, 0]] and report.first.tolist() == [[-1, -1, -1, -1]]


def test_retokenizing_merges_the_turns_paren_with_the_tools_equals():
    conv = call_conversation(turn1_eos=False)
    assert conv.text == "12*7=calc(12*7)= 84" + "84<eos>"
    v = trainer_view(conv, "retokenize", TOK)
    # re-tokenized: <bos> 1 2 * 7 = | calc ( 1 2 * 7 | ")=" straddles | " " 8 4 (tool) | 8 4 <eos>
    assert TOK.convert_ids_to_tokens(v.completion_ids) == ["calc", "(", "1", "2", "*", "7", ")=", " ", "8", "4", "8",
                                                           "4", "<eos>"]
    assert v.segment == [1] * 6 + [-1] + [2] * 3 + [3] * 3
    assert v.loss == [True] * 6 + [False] * 4 + [True] * 3  # the straddling ")=" is in no turn: out of the loss
    report = view_drift([conv], [v])
    assert report.roles == ["prompt", "turn1", "tool1", "turn2"]
    # turn 1 lost its last token (")" at position 6); the tool's ["= 8", "4"] became [" ", "8", "4"]: 3 positions
    assert report.differing.tolist() == [[0, 1, 3, 0]]
    assert report.first.tolist() == [[-1, 6, 0, -1]]
    assert report.straddling.tolist() == [1]
    metrics = report.metrics()
    assert float(metrics["multi_turn/drift_positions"]) == 4.0 and float(metrics["multi_turn/drift_rows"]) == 1.0
    assert float(retokenization_drift([conv], TOK).differing.sum()) == 4


def test_an_end_of_turn_token_keeps_the_boundary_and_retokenizing_agrees():
    conv = call_conversation(turn1_eos=True)
    engine, retok = trainer_view(conv, "engine"), trainer_view(conv, "retokenize", TOK)
    assert retok.completion_ids == engine.completion_ids and retok.loss == engine.loss
    assert retok.rollout_logp == engine.rollout_logp
    assert retokenization_drift([conv], TOK).differing.sum() == 0


def test_retokenize_aligns_mu_by_position_and_leaves_tokens_without_one_out():
    # the policy sampled "c" "a" "l" "c" (4 ids); re-tokenized it is one "calc": μ of "c" is matched to "calc"
    t = TOK.tokens
    conv = Conversation((Segment("prompt", (1,), ""), Segment("policy", t("c", "a", "l", "c"), "calc",
                                                              (-1.0, -2.0, -3.0, -4.0))))
    v = trainer_view(conv, "retokenize", TOK)
    assert v.completion_ids == list(t("calc")) and v.rollout_logp == [-1.0] and v.loss == [True]
    assert view_drift([conv], [v]).differing.tolist() == [[0, 4]]
    # the other way round: the policy sampled ")" "= 8" (2 ids); re-tokenized ")= 8" is ")=" " " "8" (3 ids): the
    # third has no μ at its position and stays out of the loss
    conv = Conversation((Segment("prompt", (1,), ""), Segment("policy", t(")", "= 8"), ")= 8", (-0.5, -0.7))))
    v = trainer_view(conv, "retokenize", TOK)
    assert TOK.convert_ids_to_tokens(v.completion_ids) == [")=", " ", "8"]
    assert v.rollout_logp == [-0.5, -0.7, 0.0] and v.loss == [True, True, False] and v.unaligned == 1
    assert view_drift([conv], [v]).differing.tolist() == [[0, 3]]


def test_a_non_canonical_split_of_the_embedded_tokenizer_is_drift():
    tok = build_tokenizer()
    se, vu = tok("se", add_special_tokens=False)["input_ids"], tok("vu", add_special_tokens=False)["input_ids"]
    sevu = tok("sevu", add_special_tokens=False)["input_ids"]
    assert len(se) == len(vu) == len(sevu) == 1  # "sevu" is one token of its own
    prompt = tok("7=")["input_ids"]
    conv = Conversation((Segment("prompt", tuple(prompt), "7="),
                         Segment("policy", (*se, *vu), "sevu", (-3.0, -4.0))))
    v = trainer_view(conv, "retokenize", tok)
    assert v.completion_ids == sevu and v.rollout_logp == [-3.0]
    assert view_drift([conv], [v]).first.tolist() == [[-1, 0]]
    assert retokenize(conv, tok).segment == [0, 0, 0, 1]


def test_bad_input_is_refused_with_the_argument_named():
    with pytest.raises(ValueError, match="logp"):
        Segment("policy", (1, 2), "x", (-1.0,))
    with pytest.raises(ValueError, match="segments"):
        Conversation((Segment("policy", (1,), "x", (-1.0,)),))
    conv = call_conversation(turn1_eos=True)
    with pytest.raises(ValueError, match="mode"):
        trainer_view(conv, "text")
    with pytest.raises(ValueError, match="tokenizer"):
        trainer_view(conv, "retokenize")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["policy", "tool"]), st.lists(st.integers(3, len(TOK) - 1), max_size=5)),
                min_size=1, max_size=6))
def test_the_engine_view_never_drifts_and_its_loss_is_exactly_the_policy_tokens(parts):
    segments = [Segment("prompt", (1, 5), "x")]
    for role, ids in parts:
        logp = tuple(-float(j + 1) for j in range(len(ids))) if role == "policy" else ()
        segments.append(Segment(role, tuple(ids), TOK.decode(ids), logp))  # type: ignore[arg-type]
    conv = Conversation(tuple(segments))
    v = trainer_view(conv, "engine")
    assert view_drift([conv], [v]).differing.sum() == 0
    assert v.loss == [s.role == "policy" for s in segments[1:] for _ in s.ids]
    assert sum(v.first) == sum(1 for s in segments[1:] if s.role == "policy" and s.ids)
