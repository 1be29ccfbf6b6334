"""Structured output: validity of the model's constrained JSON, what a constraint costs the
first token, and llguidance (the engine's) against xgrammar on the same schemas.

* **validity**: each of 20 schemas (nested objects, arrays, enums, ``required``, bounded
  numbers, patterned strings), greedy and at T = 0.8, ``max_tokens`` 512, all in one batch:
  every output must parse and validate with ``jsonschema`` (one cut by the length limit fails);
* **first token**: TTFT of a lone request, unconstrained, with a schema never seen, and with a
  schema already compiled, interleaved over the schemas (medians, and the differences);
* **libraries**: per schema, compile time and the time to fill one step's token mask, walked
  along the model's valid output, for llguidance and for xgrammar (when installed: the
  ``bench`` extra).

    python benchmarks/bench_structured.py --json bench_results/structured.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jsonschema
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fastdraft.engine.llm_engine import EngineConfig, LLMEngine, run_to_completion  # noqa: E402
from fastdraft.engine.loader import load_model  # noqa: E402
from fastdraft.fileio import write_json  # noqa: E402
from fastdraft.kernels.build import cpu_model  # noqa: E402
from fastdraft.models.registry import KNOWN_MODELS, pull  # noqa: E402
from fastdraft.sampling_params import Constraint, SamplingParams  # noqa: E402

_NAME = {"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"}
_EMAIL = {"type": "string", "pattern": "^[a-z]{2,10}@[a-z]{2,8}\\.(com|org|net)$"}
_DATE = {"type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])$"}


def _obj(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": required or list(properties),
            "additionalProperties": False}


SCHEMAS: list[tuple[str, dict]] = [
    ("a person", _obj({"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("a product", _obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                        "price": {"type": "number", "minimum": 0, "maximum": 10000},
                        "in_stock": {"type": "boolean"}})),
    ("a traffic light state", _obj({"color": {"enum": ["red", "amber", "green"]},
                                    "seconds_left": {"type": "integer", "minimum": 0, "maximum": 90}})),
    ("a user account", _obj({"user": _obj({"name": _NAME, "email": _EMAIL}),
                             "roles": {"type": "array", "items": {"enum": ["admin", "editor", "viewer"]},
                                       "minItems": 1, "maxItems": 3}})),
    ("a point in 3D", _obj({"x": {"type": "number", "minimum": -100, "maximum": 100},
                            "y": {"type": "number", "minimum": -100, "maximum": 100},
                            "z": {"type": "number", "minimum": -100, "maximum": 100}})),
    ("a meeting", _obj({"title": {"type": "string", "maxLength": 40}, "date": _DATE,
                        "attendees": {"type": "array", "items": _NAME, "minItems": 1, "maxItems": 4}})),
    ("an HTTP response", _obj({"status": {"enum": [200, 201, 400, 404, 500]},
                               "headers": {"type": "array", "maxItems": 3,
                                           "items": _obj({"name": {"enum": ["Content-Type", "Cache-Control"]},
                                                          "value": {"type": "string", "maxLength": 30}})}})),
    ("a weather report", _obj({"city": _NAME, "celsius": {"type": "integer", "minimum": -50, "maximum": 55},
                               "sky": {"enum": ["clear", "cloudy", "rain", "snow"]}})),
    ("a book", _obj({"title": {"type": "string", "maxLength": 50}, "author": _NAME,
                     "year": {"type": "integer", "minimum": 1450, "maximum": 2026},
                     "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}})),
    ("an order", _obj({"order_id": {"type": "integer", "minimum": 1, "maximum": 999999},
                       "items": {"type": "array", "minItems": 1, "maxItems": 3,
                                 "items": _obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                                                "quantity": {"type": "integer", "minimum": 1, "maximum": 9}})},
                       "paid": {"type": "boolean"}})),
    ("a git commit", _obj({"sha": {"type": "string", "pattern": "^[0-9a-f]{7}$"},
                           "message": {"type": "string", "maxLength": 60}, "files_changed": {"type": "integer",
                                                                                            "minimum": 1,
                                                                                            "maximum": 50}})),
    ("a color", _obj({"name": {"enum": ["red", "green", "blue", "black", "white"]},
                      "rgb": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255},
                              "minItems": 3, "maxItems": 3}})),
    ("a flight", _obj({"from": {"type": "string", "pattern": "^[A-Z]{3}$"},
                       "to": {"type": "string", "pattern": "^[A-Z]{3}$"}, "date": _DATE,
                       "seats": {"type": "integer", "minimum": 1, "maximum": 9}})),
    ("a recipe", _obj({"dish": {"type": "string", "maxLength": 30},
                       "steps": {"type": "array", "items": {"type": "string", "maxLength": 50}, "minItems": 1,
                                 "maxItems": 3},
                       "vegetarian": {"type": "boolean"}})),
    ("a log line", _obj({"level": {"enum": ["DEBUG", "INFO", "WARN", "ERROR"]},
                         "code": {"type": "integer", "minimum": 100, "maximum": 999},
                         "message": {"type": "string", "maxLength": 60}})),
    ("a company", _obj({"name": {"type": "string", "maxLength": 30},
                        "address": _obj({"street": {"type": "string", "maxLength": 30}, "city": _NAME,
                                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
                        "employees": {"type": "integer", "minimum": 1, "maximum": 100000}})),
    ("a test result", _obj({"test": {"type": "string", "pattern": "^test_[a-z_]{3,20}$"},
                            "passed": {"type": "boolean"},
                            "duration_ms": {"type": "number", "minimum": 0, "maximum": 60000}})),
    ("a chess move", _obj({"piece": {"enum": ["king", "queen", "rook", "bishop", "knight", "pawn"]},
                           "square": {"type": "string", "pattern": "^[a-h][1-8]$"}, "check": {"type": "boolean"}})),
    ("a contact card", _obj({"name": _NAME, "email": _EMAIL,
                             "phone": {"type": "string", "pattern": "^\\+[0-9]{2} [0-9]{3} [0-9]{4}$"}},
                            ["name", "email"])),
    ("a sensor reading", _obj({"sensor": {"type": "string", "pattern": "^S[0-9]{2}$"},
                               "values": {"type": "array", "items": {"type": "number", "minimum": 0,
                                                                     "maximum": 1}, "minItems": 2, "maxItems": 4},
                               "unit": {"enum": ["V", "A", "C"]}})),
]


def _prompt(engine: LLMEngine, what: str, schema: dict) -> list[int]:
    return engine.tokenizer.encode_chat([{"role": "user", "content": (
        f"Write {what} as one JSON object following this schema, and nothing else:\n{json.dumps(schema)}")}])


def _validity(engine: LLMEngine, max_tokens: int) -> dict:
    out = {}
    for temperature in (0.0, 0.8):
        prompts = [_prompt(engine, what, schema) for what, schema in SCHEMAS]
        params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i,
                                 structured_outputs=Constraint.of(json=schema))
                  for i, (_, schema) in enumerate(SCHEMAS)]
        start = time.perf_counter()
        results = run_to_completion(engine, prompts, params)
        failures = []
        for (what, schema), result in zip(SCHEMAS, results):
            completion = result.outputs[0]
            try:
                if completion.finish_reason != "stop":
                    raise ValueError(f"finished by {completion.finish_reason}")
                jsonschema.validate(json.loads(completion.text), schema)
            except (ValueError, jsonschema.ValidationError) as e:
                failures.append({"schema": what, "error": str(e)[:200], "text": completion.text[:200]})
        out[f"t{temperature}"] = {"valid": len(SCHEMAS) - len(failures), "of": len(SCHEMAS), "failures": failures,
                                  "wall_s": time.perf_counter() - start,
                                  "texts": [r.outputs[0].text for r in results]}
        print(f"T={temperature}: {len(SCHEMAS) - len(failures)}/{len(SCHEMAS)} valid "
              f"({time.perf_counter() - start:.1f} s)", flush=True)
    return out


def _ttft(engine: LLMEngine) -> dict:
    """A lone request's TTFT: unconstrained, a schema never compiled, the same schema again."""
    def first_token(prompt: list[int], constraint: Constraint | None) -> float:
        request_id = engine.add_request(prompt, SamplingParams(max_tokens=1, structured_outputs=constraint))
        ttft = None
        for delta in engine.outputs(request_id):
            ttft = delta.ttft_s if delta.ttft_s is not None else ttft
        return ttft

    times: dict[str, list[float]] = {"plain": [], "new_schema": [], "cached_schema": []}
    for i, (what, schema) in enumerate(SCHEMAS):
        prompt = _prompt(engine, what, schema)
        # A grammar never compiled: one more optional member, named anew (a title alone would not
        # change the grammar, and the compiler's own cache would find it).
        fresh = {**schema, "properties": {**schema["properties"], f"note_{time.time_ns()}": {"type": "boolean"}}}
        times["plain"].append(first_token(prompt, None))
        times["new_schema"].append(first_token(prompt, Constraint.of(json=fresh)))
        times["cached_schema"].append(first_token(prompt, Constraint.of(json=fresh)))
    medians = {k: statistics.median(v) for k, v in times.items()}
    out = {"ttft_p50_s": medians,
           "new_schema_added_ms": (medians["new_schema"] - medians["plain"]) * 1e3,
           "cached_schema_added_ms": (medians["cached_schema"] - medians["plain"]) * 1e3}
    print(f"TTFT p50: plain {medians['plain'] * 1e3:.1f} ms, new schema +{out['new_schema_added_ms']:.1f} ms, "
          f"cached +{out['cached_schema_added_ms']:.1f} ms", flush=True)
    return out


def _libraries(engine: LLMEngine, texts: list[str]) -> dict:
    """Compile time and per-step mask time of llguidance and xgrammar on each schema, walked along
    ``texts`` (valid outputs, one per schema). Each library's tokenizer view is built first, and
    each is warmed on a grammar of its own, so that only the schemas' own work is timed."""
    vocab_size = engine.vocab_size
    stop_ids = sorted(engine.scheduler.eos_token_ids)
    out: dict = {}

    import llguidance
    import llguidance.torch
    tokenizer = llguidance.LLTokenizer(engine.tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=stop_ids)
    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}))
    compile_s, mask_s = [], []
    for (_, schema), text in zip(SCHEMAS, texts):
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_json_schema(
            schema, overrides=options))
        compile_s.append(time.perf_counter() - start)
        bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
        for token in engine.tokenizer.encode(text, add_special_tokens=False):
            start = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
            mask_s.append(time.perf_counter() - start)
            if not matcher.consume_token(token):
                break
    out["llguidance"] = _summary(compile_s, mask_s)
    try:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        out["xgrammar"] = "not installed"
    else:
        hf = PreTrainedTokenizerFast(tokenizer_object=engine.tokenizer.backend)
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stop_ids)
        # One compiler, as an engine would keep it, its cache off: every schema compiles.
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        compiler.compile_json_schema({"type": "object"})
        compile_s, mask_s = [], []
        for (_, schema), text in zip(SCHEMAS, texts):
            start = time.perf_counter()
            compiled = compiler.compile_json_schema(schema, any_whitespace=False, separators=(", ", ": "))
            compile_s.append(time.perf_counter() - start)
            matcher = xgr.GrammarMatcher(compiled)
            bitmask = xgr.allocate_token_bitmask(1, vocab_size)
            for token in engine.tokenizer.encode(text, add_special_tokens=False):
                start = time.perf_counter()
                matcher.fill_next_token_bitmask(bitmask)
                mask_s.append(time.perf_counter() - start)
                if not matcher.accept_token(token):
                    break
        out["xgrammar"] = _summary(compile_s, mask_s)
    print(f"libraries: {json.dumps(out)}", flush=True)
    return out


def _summary(compile_s: list[float], mask_s: list[float]) -> dict:
    return {"compile_ms_p50": statistics.median(compile_s) * 1e3, "compile_ms_max": max(compile_s) * 1e3,
            "mask_us_p50": statistics.median(mask_s) * 1e6, "mask_us_p99": _p99(mask_s) * 1e6}


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", choices=list(KNOWN_MODELS))
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--json", type=Path, default=Path("bench_results/structured.json"))
    args = parser.parse_args()
    print(f"CPU: {cpu_model()}, {torch.get_num_threads()} threads", flush=True)
    engine = LLMEngine(load_model(pull(args.model), dtype=args.dtype, keep_gguf_quant=False), EngineConfig(max_model_len=2048))
    results: dict = {"config": {k: str(v) for k, v in vars(args).items()}, "cpu": cpu_model()}
    results["validity"] = _validity(engine, args.max_tokens)
    results["ttft"] = _ttft(engine)
    results["libraries"] = _libraries(engine, results["validity"]["t0.0"]["texts"])
    write_json(args.json, results)
    print(f"results written to {args.json}")


if __name__ == "__main__":
    main()
