"""Structured output in the engine: the tokens follow the request's constraint, each distinct
constraint compiles once, and a bad one is refused when the request arrives."""

from __future__ import annotations

import json
import re

import pytest

from fastdraft.engine.llm_engine import EngineConfig, LLMEngine, run_to_completion
from fastdraft.engine.loader import load_model
from fastdraft.engine.structured import apply_bitmask, check_constraint
from fastdraft.sampling_params import Constraint, SamplingParams
from fastdraft.speculative.factory import speculator_factory
from fastdraft.speculative.speculative_config import SpeculativeConfig

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
          "required": ["color", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def loaded(tiny_models):
    return load_model(tiny_models.dir("qwen2"), dtype="fp32")


def _engine(loaded, **kwargs) -> LLMEngine:
    return LLMEngine(loaded, EngineConfig(num_blocks=256, block_size=4, max_model_len=128), **kwargs)


def _run(engine: LLMEngine, prompts: list[str], params: list[SamplingParams]) -> list[tuple[str, str]]:
    return [(o.outputs[0].text, o.outputs[0].finish_reason) for o in run_to_completion(engine, prompts, params)]


def test_outputs_follow_their_constraints_beside_free_requests(loaded):
    prompts = ["def f(x):", "import os\n", "x = ", "# a", "class A:"]
    constraints = [Constraint.of(json=SCHEMA), Constraint.of(regex=r"[a-c]{2}-\d{3}"),
                   Constraint.of(choice=["yes", "no", "maybe so"]), None,
                   Constraint.of(grammar='root ::= "(" [0-9]+ ")" | "none"')]
    for temperature in (0.0, 1.0):
        params = [SamplingParams(max_tokens=40, temperature=temperature, seed=7, structured_outputs=c)
                  for c in constraints]
        (as_json, end_json), (code, end_code), (choice, end_choice), (_, free_end), (paren, end_paren) = \
            _run(_engine(loaded), prompts, params)
        assert json.loads(as_json)["color"] in {"red", "green", "blue"} and end_json == "stop"
        assert as_json == json.dumps(json.loads(as_json))  # compact, as json.dumps writes it
        assert re.fullmatch(r"[a-c]{2}-\d{3}", code) and end_code == "stop"
        assert choice in {"yes", "no", "maybe so"} and end_choice == "stop"
        assert re.fullmatch(r"\(\d+\)|none", paren) or end_paren == "length"
        assert free_end in {"stop", "length"}


def test_any_json_object(loaded):
    (text, finish), = _run(_engine(loaded), ["{"], [SamplingParams(max_tokens=60, structured_outputs=Constraint.of(
        json_object=True))])
    assert text.startswith("{") and (finish == "length" or isinstance(json.loads(text), dict))


def test_each_distinct_constraint_compiles_once(loaded):
    engine = _engine(loaded)
    same = [SamplingParams(max_tokens=8, structured_outputs=Constraint.of(regex=r"\d{4}")) for _ in range(3)]
    other = SamplingParams(max_tokens=8, structured_outputs=Constraint.of(regex=r"[xy]{3}"))
    run_to_completion(engine, ["a", "b", "c", "d"], [*same, other])
    assert len(engine.structured._compiled) == 2


def test_greedy_constrained_output_is_the_same_with_speculation(loaded):
    prompts = ["def f(x):", "x = 1\n"]
    params = [SamplingParams(max_tokens=30, structured_outputs=Constraint.of(json=SCHEMA)),
              SamplingParams(max_tokens=12, structured_outputs=Constraint.of(regex=r"[a-z ]{5,12}"))]
    plain = _run(_engine(loaded), prompts, params)
    speculation = speculator_factory(SpeculativeConfig(draft="ngram", is_adaptive=False, min_confidence=0.0))
    assert _run(_engine(loaded, speculation=speculation), prompts, params) == plain


def test_an_aborted_request_leaves_no_grammar_state(loaded):
    engine = _engine(loaded)
    request_id = engine.add_request("x", SamplingParams(max_tokens=30, structured_outputs=Constraint.of(json=SCHEMA)))
    engine.step()
    assert engine.abort_request(request_id)
    while engine.has_unfinished_requests:
        engine.step()
    assert not engine.structured._matchers and not engine._compiling


@pytest.mark.parametrize("constraint, problem", [
    (Constraint.of(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}), "JSON schema"),
    (Constraint.of(regex="(unclosed"), "regex"),
    (Constraint.of(grammar="root ::= missing_rule"), "grammar"),
])
def test_a_bad_constraint_is_refused_naming_it(loaded, constraint, problem):
    with pytest.raises(ValueError, match=f"invalid {problem}"):
        check_constraint(constraint)
    with pytest.raises(ValueError, match=f"invalid {problem}"):
        _engine(loaded).add_request("x", SamplingParams(max_tokens=8, structured_outputs=constraint))


def test_a_constraint_is_exactly_one_thing():
    with pytest.raises(ValueError, match="exactly one"):
        Constraint.of(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="exactly one"):
        Constraint.of()
    with pytest.raises(ValueError, match="non-empty list"):
        Constraint.of(choice=[])
    with pytest.raises(ValueError, match="JSON schema"):
        Constraint.of(json="{not json")


def test_the_bitmask_kernel_matches_a_token_by_token_reference():
    import torch

    generator = torch.Generator().manual_seed(0)
    vocab_size = 1000  # not a multiple of 32: the last word's high bits lie past the vocabulary
    logits = torch.randn(5, vocab_size, generator=generator)  # [num_rows, vocab_size]
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, -(-vocab_size // 32)), dtype=torch.int32, generator=generator)
    rows = [0, 2, 3]
    expected, actual = logits.clone(), logits.clone()
    for row in rows:
        for token in range(vocab_size):
            if not (int(bitmask[row, token // 32]) >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    apply_bitmask(actual, bitmask, rows)
    assert torch.equal(actual, expected) and torch.equal(actual[1], logits[1])


def test_a_preempted_constrained_request_keeps_its_grammar_state(loaded):
    # A pool too small for every request at once: the newest are preempted and recomputed, and
    # their matchers (which saw their tokens once) still follow the same output as a roomy pool's.
    prompts = [f"item {i}:" for i in range(4)]
    params = [SamplingParams(max_tokens=40, structured_outputs=Constraint.of(regex=r"[a-z]{30,40}"))] * 4
    roomy = _run(_engine(loaded), prompts, params)
    small = LLMEngine(loaded, EngineConfig(num_blocks=24, block_size=4, max_model_len=64))
    assert _run(small, prompts, params) == roomy
    assert small.scheduler.num_preemptions > 0
    assert all(finish in {"stop", "length"} and 30 <= len(text) <= 40 for text, finish in roomy)


def test_a_lark_grammar_is_read_as_well_as_gbnf(loaded):
    (text, finish), = _run(_engine(loaded), ["x"], [SamplingParams(max_tokens=10, structured_outputs=Constraint.of(
        grammar='start: "ab" | "cd" NUM\nNUM: /[0-9]/'))])
    assert re.fullmatch(r"ab|cd[0-9]", text) and finish == "stop"


def test_the_tokenizers_grammar_view_is_built_on_demand_or_when_prepared(loaded):
    engine = _engine(loaded)  # no constrained request yet: nothing built
    assert engine.structured._tokenizer is None
    engine.structured.prepare()  # a server's start
    assert engine.structured._tokenizer.result(timeout=60).vocab_size == engine.vocab_size


def test_a_schema_closes_the_objects_it_leaves_open_and_nothing_else():
    from fastdraft.engine.structured import _closed

    item = {"type": "object", "properties": {"properties": {"type": "string"}}}
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": item},
                                               "pair": {"type": "array", "prefixItems": [{"type": "integer"}]},
                                               "open": {"type": "object", "properties": {},
                                                        "additionalProperties": True}},
              "$defs": {"d": {"type": "object", "properties": {"x": {"const": {"properties": {}}}}}},
              "default": {"properties": {}}}
    closed = _closed(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["items"]["items"] == {**item, "additionalProperties": False}
    assert "additionalProperties" not in closed["properties"]["items"]["items"]["properties"]  # a member's name
    assert closed["properties"]["pair"]["items"] is False
    assert closed["properties"]["open"]["additionalProperties"] is True
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert closed["$defs"]["d"]["properties"]["x"] == {"const": {"properties": {}}}  # data, left as it is
    assert closed["default"] == {"properties": {}} and "$defs" not in closed["properties"]
    assert _closed({"type": "object"}) == {"type": "object"}  # any object: JSON mode
