"""Tool calls: how often a call parses and validates, and what tools cost the first token.

Each of 20 tools takes one of ``bench_structured.py``'s schemas as its ``parameters`` (nested
objects, arrays, enums, optional fields, bounded numbers, patterned strings); a second tool
stands beside it as a distractor. Through ``LLM.chat`` (the server's path):

* **validity**: under ``tool_choice`` naming the tool, ``required`` and ``auto``, greedy and at
  T = 0.8: the share of replies whose call parses and whose arguments validate with
  ``jsonschema`` against the called tool's schema;
* **first token**: TTFT of the same rendered prompt (the tools in the template) without
  parsing or a grammar, with a named call's grammar never seen, and with it compiled already,
  interleaved over the tools (medians, and the differences).

    python benchmarks/bench_tools.py --json bench_results/tools.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import jsonschema
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_structured import SCHEMAS  # noqa: E402

from fastdraft.fileio import write_json  # noqa: E402
from fastdraft.kernels.build import cpu_model  # noqa: E402
from fastdraft.llm import LLM  # noqa: E402
from fastdraft.models.registry import KNOWN_MODELS, pull  # noqa: E402
from fastdraft.sampling_params import SamplingParams  # noqa: E402

DISTRACTOR = {"type": "function", "function": {
    "name": "search_web", "description": "Search the web for a query.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}


def tools_of_schemas() -> list[tuple[dict, str]]:
    """(a tool whose parameters are a schema, the request that asks for it) per schema."""
    out = []
    for what, schema in SCHEMAS:
        name = "record_" + what.removeprefix("a ").removeprefix("an ").replace(" ", "_").replace("3D", "3d").lower()
        tool = {"type": "function", "function": {"name": name, "description": f"Record {what}.",
                                                 "parameters": schema}}
        out.append((tool, f"Please record {what} with made-up but realistic values, using the tool."))
    return out


def _valid(calls: list[dict] | None, tools: list[dict]) -> bool:
    if not calls:
        return False
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for call in calls:
        schema = by_name.get(call["function"]["name"])
        try:
            jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
        except (TypeError, ValueError, jsonschema.ValidationError):
            return False
    return True


def validity(llm: LLM, max_tokens: int) -> dict:
    out = {}
    for mode in ("named", "required", "auto"):
        for temperature in (0.0, 0.8):
            ok = 0
            for i, (tool, ask) in enumerate(tools_of_schemas()):
                tools = [tool, DISTRACTOR]
                choice = {"named": {"type": "function", "function": {"name": tool["function"]["name"]}},
                          "required": "required", "auto": "auto"}[mode]
                params = SamplingParams(max_new_tokens=max_tokens, temperature=temperature, seed=i)
                completion = llm.chat([{"role": "user", "content": ask}], params, tools=tools, tool_choice=choice,
                                      parallel_tool_calls=False).outputs[0]
                ok += _valid(completion.tool_calls, tools)
            out[f"{mode}, T={temperature}"] = f"{ok}/{len(SCHEMAS)}"
            print(f"  {mode}, T = {temperature}: {ok}/{len(SCHEMAS)} calls parse and validate", flush=True)
    return out


def first_token(llm: LLM, rounds: int) -> dict:
    """TTFT (one new token) of each tool's request: plain (the rendered prompt, no grammar),
    with a new grammar (the tool renamed each round, so never compiled before), and with the
    grammar compiled already."""
    times: dict[str, list[float]] = {"plain": [], "new grammar": [], "cached grammar": []}
    params = SamplingParams(max_new_tokens=1)
    for r in range(rounds):
        for tool, ask in tools_of_schemas():
            renamed = json.loads(json.dumps(tool))
            renamed["function"]["name"] += f"_{r}"
            messages = [{"role": "user", "content": ask}]
            named = {"type": "function", "function": {"name": renamed["function"]["name"]}}
            # auto: the tools rendered as for the others, no grammar (its parsing comes after the reply)
            plain = llm.chat(messages, params, tools=[renamed, DISTRACTOR], tool_choice="auto")
            fresh = llm.chat(messages, params, tools=[renamed, DISTRACTOR], tool_choice=named)
            cached = llm.chat(messages, params, tools=[renamed, DISTRACTOR], tool_choice=named)
            times["plain"].append(plain.metrics.ttft_s)
            times["new grammar"].append(fresh.metrics.ttft_s)
            times["cached grammar"].append(cached.metrics.ttft_s)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {**{f"{k} ms": round(v, 1) for k, v in med.items()},
            "new grammar - plain ms": round(med["new grammar"] - med["plain"], 1),
            "cached grammar - plain ms": round(med["cached grammar"] - med["plain"], 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", choices=sorted(KNOWN_MODELS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the first-token timing")
    parser.add_argument("--no-validity", action="store_true", help="time the first token only")
    parser.add_argument("--json", type=Path, default=Path("bench_results/tools.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # No prefix cache: a rendered prompt would otherwise be found cached by its twin.
    llm = LLM(model=str(pull(args.model)), max_model_len=4096, enable_prefix_caching=False)
    print(f"CPU: {cpu_model()}; {args.model} (its GGUF's own blocks), {args.threads} threads", flush=True)
    report = {"cpu": cpu_model(), "model": args.model}
    if not args.no_validity:
        report["validity"] = validity(llm, args.max_tokens)
    report["first_token"] = first_token(llm, args.rounds)
    print("  first token: " + ", ".join(f"{k} {v}" for k, v in report["first_token"].items()), flush=True)
    write_json(args.json, report)
    print(f"results written to {args.json}")


if __name__ == "__main__":
    main()
