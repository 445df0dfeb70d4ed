"""Structured output from `mtplx serve` on the default model with speculation on: how many
``json_schema`` / ``json_object`` replies end with ``stop``, and whether every one of them parses
and validates (issue 26). The tests check the same on a tiny random model, whose replies are
valid only because the grammar held them; this is the default model's share cut by ``max_tokens``.

The real server process (its defaults: the shipped head, auto drafter) and the `openai` client;
prompts that ask for JSON in several ways; temperatures 0 and 0.8, a seed per request.

    python benchmarks/json_replies.py [--seeds 3] [--max-tokens 160]

Writes benchmarks/results/json-replies.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mtplx.bench.report import provenance, write_json

import jsonschema
from serve_concurrency import ROOT, ServerSpec, base_env, client_for, serving  # noqa: I001

OUT = ROOT / "benchmarks" / "results" / "json-replies.json"
SCHEMA = {  # strings and arrays bounded, no extra keys: a reply of this schema always fits
    "type": "object",
    "properties": {
        "destination": {"type": "string", "maxLength": 32},
        "days": {"type": "integer", "minimum": 1, "maximum": 30},
        "activities": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 4},
    },
    "required": ["destination", "days", "activities"],
    "additionalProperties": False,
}
PROMPTS = [
    "Plan a short trip and answer in JSON.",
    "Give a JSON object with the keys name and age for a person.",
    "Return a JSON object describing the weather in Paris with two fields.",
    "Describe your favourite book as a JSON object.",
]
FORMATS = {
    "json_schema": {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True}},
    "json_object": {"type": "json_object"},
}


def check(content: str, name: str) -> None:
    """Raises if ``content`` is not one JSON value valid for format ``name``."""
    value = json.loads(content)
    jsonschema.validate(value, SCHEMA if name == "json_schema" else {"type": "object"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3, help="requests per (prompt, format, temperature)")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    env = dict(base_env(), PYTHONPATH=str(ROOT))
    spec = ServerSpec("mtplx", (sys.executable, "-m", "mtplx", "serve"), env, None)
    replies, summary = [], {}
    with serving(spec) as server:
        client = client_for(server)
        for temperature in (0.0, 0.8):
            for name, fmt in FORMATS.items():
                cell = summary.setdefault(f"{name} t{temperature}", {"stop": 0, "length": 0, "invalid": 0})
                for prompt in PROMPTS:
                    for seed in range(args.seeds):
                        reply = client.chat.completions.create(
                            model=server.model_id,
                            messages=[{"role": "user", "content": prompt}],
                            response_format=fmt,
                            max_tokens=args.max_tokens,
                            temperature=temperature,
                            seed=seed,
                        )
                        choice = reply.choices[0]
                        error = None
                        if choice.finish_reason == "stop":
                            try:
                                check(choice.message.content, name)
                            except (ValueError, jsonschema.ValidationError) as err:
                                error = str(err).splitlines()[0]
                                cell["invalid"] += 1
                        cell[choice.finish_reason] = cell.get(choice.finish_reason, 0) + 1
                        replies.append(
                            dict(
                                format=name,
                                temperature=temperature,
                                prompt=prompt,
                                seed=seed,
                                finish=choice.finish_reason,
                                tokens=reply.usage.completion_tokens,
                                error=error,
                                content=choice.message.content,
                            )
                        )
                print(f"{name} t{temperature}: {cell}", flush=True)
    write_json(args.out, {**provenance(vars(args)), "summary": summary, "replies": replies})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
