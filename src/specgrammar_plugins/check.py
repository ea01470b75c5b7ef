"""``specgrammar check SCHEMA_OR_GRAMMAR``: compile a constraint with each engine, say what each enforces, time it.

For a JSON Schema it lists the exact rewrites applied before compiling (keyword, JSON pointer, what it became),
then per engine what it enforces or the keyword it refuses with its pointer, and which engine the default for the
constraint's kind (``compiler.DEFAULTS``) picks.

    specgrammar check schema.json                 # a JSON Schema file (or inline JSON)
    specgrammar check grammar.gbnf                # GBNF (.lark: Lark, .ebnf: xgrammar EBNF)
    specgrammar check --regex '[A-Z]{3}-[0-9]{4}'
    specgrammar check schema.json --tokenizer path/to/tokenizer.json --vocab-size 151936
Exit status 0 when at least one engine compiles it, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from .compiler import compile_constraint, default_engine, policy_engines
from .constraint import ConstraintSpec
from .errors import ConstraintError

ENGINES = ("xgrammar", "llguidance", "outlines_core", "dfa")


def _spec(arg: str, regex: bool, syntax: str | None) -> ConstraintSpec:
    if regex:
        return ConstraintSpec.regex(arg)
    p = Path(arg)
    text = p.read_text() if p.exists() else arg
    suffix = p.suffix.lower() if p.exists() else ""
    if syntax or suffix in (".gbnf", ".lark", ".ebnf"):
        return ConstraintSpec.grammar(text, syntax or suffix[1:])
    try:
        return ConstraintSpec.json_schema(json.loads(text))
    except json.JSONDecodeError:
        return ConstraintSpec.grammar(text, "gbnf")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specgrammar check", description=__doc__.splitlines()[0])
    ap.add_argument("constraint", help="a JSON Schema / grammar file, or inline text")
    ap.add_argument("--regex", action="store_true", help="the argument is a regex")
    ap.add_argument("--syntax", choices=("gbnf", "lark", "ebnf"), help="grammar syntax (default: by file suffix)")
    ap.add_argument("--tokenizer", help="tokenizer.json or folder (default: the bundled tiny model's)")
    ap.add_argument("--vocab-size", type=int, default=None, help="mask width (the model's output size)")
    a = ap.parse_args(argv)
    try:
        spec = _spec(a.constraint, a.regex, a.syntax)
    except ConstraintError as e:
        print(f"error: {e}")
        return 1
    if a.tokenizer:
        from .tokenizer import TokenizerInfo

        tok = TokenizerInfo.from_file(a.tokenizer, vocab_size=a.vocab_size)
    else:
        from .models import tiny_tokenizer_info

        tok = tiny_tokenizer_info(a.vocab_size)
    print(f"constraint: {spec.kind}{' (' + spec.syntax + ')' if spec.syntax else ''}; tokenizer {tok.name} "
          f"({len(tok.token_bytes)} tokens, mask width {tok.vocab_size})")
    if spec.kind == "json_schema":
        from .schema_rewrite import rewrite

        rw = rewrite(spec.schema)
        print(f"exact rewrites before compiling: {len(rw.rewrites) or 'none'}")
        for r in rw.rewrites:
            print(f"  {r}")
    ok = False
    for engine in ENGINES:
        t0 = time.perf_counter()
        try:
            c = compile_constraint(spec, tok, engine=engine, cache=None)
        except ConstraintError as e:
            print(f"  {engine:14} refused ({(time.perf_counter() - t0) * 1e3:8.1f} ms): {e.reason.splitlines()[0][:160]}")
            continue
        ok = True
        line = f"  {engine:14} compiled {c.compile_ms:8.1f} ms"
        if spec.kind == "json_schema":
            from .schema import check_schema

            rep = check_schema(c.spec.schema, engine)
            line += f"; enforces {', '.join(sorted(rep.enforced)) or '-'}"
            if rep.ignored:
                line += f"; ignores (annotations) {', '.join(sorted(rep.ignored))}"
        print(line)
    default = default_engine(spec)
    how = f"{default}: the first of {', '.join(policy_engines(spec))} that compiles it" if default == "auto" else default
    try:
        pick = compile_constraint(spec, tok).engine
        print(f"default for {spec.kind} ({how}) picks: {pick}")
    except ConstraintError:
        print(f"default for {spec.kind} ({how}): refused")
    return 0 if ok else 1
