"""Training requests for recipe packs: a seeded JSON Lines file of requests that are never the eval prompts.

Each line is a request as a client would send it: ``messages`` (one user turn) plus the constraint in the
project's request-field spelling (``response_format`` for JSON Schemas, ``regex``, ``grammar``), and
``workload`` (which pack it feeds).  ``specgrammar recipes build --requests FILE`` runs the model on them.

Two sources, both disjoint from what the benchmarks measure on:

- the six structured workloads' *train* split (``workloads.examples(w, "train")``: a content hash puts every
  candidate prompt in exactly one split, so no train prompt is an eval prompt), each phrased by the workload's own
  templates;
- generated JSON Schemas (``synthetic_schema``: seeded property names, types, nesting, enums, arrays), asked for
  with the prompt ``bench schemas`` uses for real schemas ("Give a JSON object for this schema: ..."), so a pack
  learns the model's JSON layout at every depth without seeing one of the dev-split schemas it is measured on
  (those are read from files; these are made here).
"""

from __future__ import annotations

import json
import random
from typing import Iterator

from ..workloads import STRUCTURED, examples

SEED = 20261126
_WORDS = ("id", "title", "status", "count", "price", "email", "city", "country", "created", "updated", "tags",
          "owner", "version", "enabled", "score", "label", "color", "size", "weight", "phone", "address", "zip",
          "street", "notes", "priority", "category", "rating", "author", "year", "month", "url", "language",
          "currency", "amount", "quantity", "active", "role", "team", "level", "duration", "start", "end", "type",
          "description", "summary", "source", "target", "width", "height", "unit", "region", "code", "total")
_ENUMS = (("low", "medium", "high"), ("red", "green", "blue"), ("open", "closed"), ("admin", "user", "guest"),
          ("small", "large"), ("draft", "published", "archived"))


def _leaf(r: random.Random) -> dict:
    kind = r.choice(("string", "string", "integer", "number", "boolean", "enum", "array"))
    if kind == "enum":
        return {"type": "string", "enum": list(r.choice(_ENUMS))}
    if kind == "array":
        return {"type": "array", "items": {"type": r.choice(("string", "integer"))}, "maxItems": r.randint(2, 4)}
    return {"type": kind}


def synthetic_schema(r: random.Random, depth: int = 0) -> dict:
    """A seeded object schema: 2-6 properties, leaves of the common types, sometimes a nested object."""
    names = r.sample(_WORDS, r.randint(2, 6 if depth == 0 else 4))
    props = {}
    for n in names:
        props[n] = synthetic_schema(r, depth + 1) if depth < 2 and r.random() < 0.2 else _leaf(r)
    required = [n for n in names if r.random() < 0.8] or names[:1]
    return {"type": "object", "properties": props, "required": required}


def schema_prompt(schema: dict, max_chars: int = 300) -> str:
    """The prompt ``bench schemas`` gives a schema (the user turn only)."""
    text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    if len(text) > max_chars:
        text = text[:max_chars] + " ..."
    return "Give a JSON object for this schema: " + text


def constraint_fields(spec) -> dict:
    """A ``ConstraintSpec`` in the request-field spelling (``requests.parse_request`` reads it back)."""
    if spec.kind == "json_schema":
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": spec.schema}}}
    if spec.kind == "regex":
        return {"regex": spec.value}
    if spec.kind == "grammar":
        return {"grammar": spec.value, "grammar_syntax": spec.syntax or "gbnf"}
    raise ValueError(f"no request-field spelling for a {spec.kind} constraint")


def training_requests(n: int = 40, schemas: int = 60, seed: int = SEED) -> Iterator[dict]:
    """``n`` train-split requests per structured workload, then ``schemas`` generated-schema requests."""
    for w in STRUCTURED:
        for ex in examples(w, "train", n):
            yield {"workload": w, "messages": [{"role": "user", "content": ex.prompt}], **constraint_fields(ex.constraint)}
    r = random.Random(f"{seed}/schemas")
    for _ in range(schemas):
        s = synthetic_schema(r)
        yield {"workload": "schemas", "messages": [{"role": "user", "content": schema_prompt(s)}],
               "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": s}}}


def eval_prompts(n: int = 50) -> set[str]:
    """Every eval prompt of the six workloads (the default eval size): what training must never hold."""
    return {ex.prompt for w in STRUCTURED for ex in examples(w, "eval", n)}
