"""The workload suite: seeded generators of prompts, constraints and reference answers.

Seven named workloads, six structured and one control::

    json_extraction  "Extract the user info as JSON: John Smith, age 32, engineer" -> a JSON Schema'd object
    order_id         regex  [A-Z]{3}-[0-9]{4}
    year             regex  [0-9]{4}
    email            regex  [a-z]+@[a-z]+\\.com
    sql              GBNF (llama.cpp dialect, root rule ``root``) for a small SELECT subset
    tool_call        JSON Schema: {"name": <function>, "parameters": {...}} over four functions (anyOf)
    prose            free text, no constraint (the control)

Answers are determined by the prompt (values are copied from it), so a ~3M-parameter model can learn them.
Within a workload every example shares ONE constraint, so one compiled grammar serves them all.

Splits are deterministic and disjoint: each candidate prompt is hashed (sha256) into one of ten buckets;
bucket 0 is ``eval``, the rest ``train``.  Each split draws from its own seeded stream and drops duplicates,
so ``examples(w, s, n)`` is a prefix of ``examples(w, s, m)`` for n <= m.

JSON objects list their properties in alphabetical order (``ConstraintSpec.json_schema`` canonicalizes the
schema with sorted keys, and engines such as xgrammar emit properties in schema order): the reference answers
use the same order, so they are in the language whichever order an engine reads.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from functools import lru_cache

from .constraint import ConstraintSpec

WORKLOADS: tuple[str, ...] = ("json_extraction", "order_id", "year", "email", "sql", "tool_call", "prose")
STRUCTURED: tuple[str, ...] = tuple(w for w in WORKLOADS if w != "prose")
SPLITS = ("train", "eval")
DEFAULT_N = {"train": 3000, "eval": 50}
EOS = "<|im_end|>"


@dataclass(frozen=True)
class Example:
    workload: str
    prompt: str  # the user message text
    constraint: ConstraintSpec | None  # None for prose
    reference: str  # what a perfect model outputs after the assistant header (without the EOS token)


def chat_prompt(user: str) -> str:
    """The ChatML text a model sees before its answer."""
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def training_text(ex: Example) -> str:
    """Prompt, answer and EOS: one training document."""
    return chat_prompt(ex.prompt) + ex.reference + EOS


# ---------------------------------------------------------------------------------------------- value pools
FIRST = ("John", "Maria", "Ahmed", "Li", "Sofia", "Peter", "Anna", "David", "Emma", "Lucas", "Olga", "Raj",
         "Chen", "Fatima", "Tom", "Laura", "Omar", "Julia", "Ivan", "Grace", "Paul", "Nina", "Carlos", "Sara",
         "Mark", "Elena", "Kenji", "Amy", "Hugo", "Zoe", "Leo", "Mia", "Oscar", "Ruth", "Victor", "Lena")
LAST = ("Smith", "Lopez", "Khan", "Wang", "Rossi", "Novak", "Berg", "Miller", "Brown", "Silva", "Petrov", "Patel",
        "Zhang", "Ali", "Jones", "Weber", "Haddad", "Meyer", "Ivanov", "Kim", "Fischer", "Costa", "Garcia", "Moreau",
        "Taylor", "Young", "Tanaka", "Clark", "Martin", "Adams", "Reed", "Cruz", "Hughes", "Stone", "Fox", "Lang")
OCCUPATIONS = ("engineer", "teacher", "doctor", "nurse", "artist", "lawyer", "chef", "pilot", "writer", "designer",
               "farmer", "dentist", "architect", "electrician", "plumber", "scientist", "musician", "accountant",
               "baker", "photographer", "editor", "mechanic", "pharmacist", "librarian")
CITIES = ("Paris", "London", "Berlin", "Tokyo", "Madrid", "Rome", "Vienna", "Oslo", "Cairo", "Lima", "Dublin",
          "Prague", "Boston", "Seattle", "Denver", "Sydney", "Toronto", "Lisbon", "Athens", "Warsaw", "Delhi", "Seoul",
          "Austin", "Chicago", "Munich", "Milan", "Zurich", "Nairobi")
DOMAINS = ("example", "mail", "acme", "post", "inbox", "corp", "webmail", "company", "school", "shop", "cloud",
           "studio", "office", "home")
COMPANIES = ("Acme", "Globex", "Initech", "Umbrella", "Stark", "Wayne", "Hooli", "Vandelay", "Soylent", "Tyrell")
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
GIFTS = ("flowers", "book", "card", "scarf", "cake", "tea", "painting", "plant", "mug", "chocolate")
SUBJECTS = ("the meeting", "lunch plans", "the report", "the invoice", "the trip", "the party", "the budget",
            "the contract", "the schedule", "the launch")
QUERIES = ("cheap flights", "pasta recipes", "python tutorials", "hiking trails", "used bikes", "jazz concerts",
           "yoga classes", "museum tickets", "train times", "coffee shops", "book reviews", "solar panels")

# SQL: tables and their columns (numeric / text)
SQL_TABLES = {
    "users": (("age", "id"), ("name", "city")),
    "orders": (("total", "id", "quantity"), ("status", "customer")),
    "products": (("price", "stock", "id"), ("name", "category")),
    "employees": (("salary", "age", "id"), ("name", "department", "city")),
    "books": (("pages", "year", "id"), ("title", "author", "genre")),
}
SQL_TEXT_VALUES = {"city": CITIES, "name": FIRST, "status": ("shipped", "pending", "cancelled"),
                   "customer": FIRST, "category": ("toys", "books", "garden", "tools", "food"),
                   "department": ("sales", "support", "research", "finance"), "title": ("Dune", "Emma", "Ulysses"),
                   "author": LAST, "genre": ("poetry", "drama", "fantasy", "history")}
SQL_OPS = (("is greater than", ">"), ("is less than", "<"), ("equals", "="), ("is at least", ">="),
           ("is at most", "<="), ("is not", "!="))

# ---------------------------------------------------------------------------------------------- constraints
JSON_EXTRACTION_SCHEMA = {
    "type": "object",
    "properties": {
        "age": {"type": "integer"},
        "name": {"type": "string"},
        "occupation": {"type": "string"},
    },
    "required": ["age", "name", "occupation"],
    "additionalProperties": False,
}


def _tool(name: str, params: dict, required: list[str]) -> dict:
    return {
        "type": "object",
        "properties": {
            "name": {"const": name},
            "parameters": {"type": "object", "properties": params, "required": required,
                           "additionalProperties": False},
        },
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }


TOOL_CALL_SCHEMA = {
    "anyOf": [
        _tool("get_weather", {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
              ["city", "unit"]),
        _tool("search_web", {"query": {"type": "string"}}, ["query"]),
        _tool("send_email", {"recipient": {"type": "string"}, "subject": {"type": "string"}},
              ["recipient", "subject"]),
        _tool("set_timer", {"minutes": {"type": "integer"}}, ["minutes"]),
    ]
}

ORDER_ID_REGEX = r"[A-Z]{3}-[0-9]{4}"
YEAR_REGEX = r"[0-9]{4}"
EMAIL_REGEX = r"[a-z]+@[a-z]+\.com"

SQL_GBNF = r"""root ::= "SELECT " select " FROM " ident where? order? limit? ";"
select ::= "*" | ident (", " ident)*
where ::= " WHERE " cond (" AND " cond)*
cond ::= ident " " op " " value
op ::= "=" | "!=" | "<=" | ">=" | "<" | ">"
value ::= [0-9]+ | "'" [A-Za-z ]* "'"
order ::= " ORDER BY " ident (" ASC" | " DESC")?
limit ::= " LIMIT " [0-9]+
ident ::= [a-z_] [a-z0-9_]*
"""
# The same language as SQL_GBNF, as a Python regex (the grammar has no recursion); tests hold the two equal.
_IDENT = r"[a-z_][a-z0-9_]*"
_COND = rf"{_IDENT} (?:=|!=|<=|>=|<|>) (?:[0-9]+|'[A-Za-z ]*')"
SQL_REGEX = (rf"SELECT (?:\*|{_IDENT}(?:, {_IDENT})*) FROM {_IDENT}(?: WHERE {_COND}(?: AND {_COND})*)?"
             rf"(?: ORDER BY {_IDENT}(?: ASC| DESC)?)?(?: LIMIT [0-9]+)?;")


@lru_cache(maxsize=None)
def constraint(workload: str) -> ConstraintSpec | None:
    """The one constraint every example of ``workload`` shares (None for prose)."""
    if workload == "json_extraction":
        return ConstraintSpec.json_schema(JSON_EXTRACTION_SCHEMA)
    if workload == "order_id":
        return ConstraintSpec.regex(ORDER_ID_REGEX)
    if workload == "year":
        return ConstraintSpec.regex(YEAR_REGEX)
    if workload == "email":
        return ConstraintSpec.regex(EMAIL_REGEX)
    if workload == "sql":
        return ConstraintSpec.grammar(SQL_GBNF, syntax="gbnf")
    if workload == "tool_call":
        return ConstraintSpec.json_schema(TOOL_CALL_SCHEMA)
    if workload == "prose":
        return None
    raise KeyError(f"unknown workload {workload!r}; expected one of {', '.join(WORKLOADS)}")


def is_valid(workload: str, text: str) -> bool:
    """``text`` (an answer, without EOS) is in the language of ``workload``'s constraint (always True for prose).

    Regexes by ``re.fullmatch``, JSON schemas by ``json.loads`` (lenient about control characters, as xgrammar
    lets them into strings) and ``jsonschema``, the SQL grammar by its equivalent regex ``SQL_REGEX``.
    """
    import re

    spec = constraint(workload)
    if spec is None:
        return True
    if spec.kind == "regex":
        return re.fullmatch(spec.value, text) is not None
    if workload == "sql":
        return re.fullmatch(SQL_REGEX, text) is not None
    if spec.kind == "json_schema":
        try:
            value = json.loads(text, strict=False)
        except ValueError:
            return False
        return _validator(workload).is_valid(value)
    raise NotImplementedError(spec.kind)


@lru_cache(maxsize=None)
def _validator(workload: str):
    import jsonschema

    schema = constraint(workload).schema
    return jsonschema.validators.validator_for(schema)(schema)


# ---------------------------------------------------------------------------------------------- generators
def _an(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _gen_json_extraction(r: random.Random) -> tuple[str, str]:
    name = f"{r.choice(FIRST)} {r.choice(LAST)}"
    age = r.randint(18, 80)
    occ = r.choice(OCCUPATIONS)
    text = r.choice((
        f"{name}, age {age}, {occ}",
        f"{name} is {_an(occ)}, {age} years old.",
        f"{name} is a {age}-year-old {occ}.",
        f"Name: {name}. Age: {age}. Job: {occ}.",
        f"Meet {name}, {_an(occ)} aged {age}.",
    ))
    return f"Extract the user info as JSON: {text}", json.dumps({"age": age, "name": name, "occupation": occ})


def _gen_order_id(r: random.Random) -> tuple[str, str]:
    oid = "".join(r.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(3)) + "-" + f"{r.randint(0, 9999):04d}"
    text = r.choice((
        f"Hi, my order {oid} has not arrived yet.",
        f"Package {oid} was shipped to {r.choice(CITIES)} on {r.choice(DAYS)}.",
        f"{r.choice(FIRST)} asked about order {oid} yesterday.",
        f"Please cancel {oid}, I ordered the wrong size.",
        f"Order {oid} for {r.randint(2, 9)} items is ready.",
    ))
    return f"Find the order ID: {text}", oid


def _gen_year(r: random.Random) -> tuple[str, str]:
    year = str(r.randint(1800, 2030))
    text = r.choice((
        f"The bridge in {r.choice(CITIES)} opened in {year}.",
        f"{r.choice(FIRST)} {r.choice(LAST)} was born in {year} in {r.choice(CITIES)}.",
        f"In {year}, the company {r.choice(COMPANIES)} was founded.",
        f"The museum bought the painting in {year} for {r.randint(2, 90)} thousand.",
        f"{r.choice(COMPANIES)} moved to {r.choice(CITIES)} in {year}.",
    ))
    return f"Find the year: {text}", year


def _gen_email(r: random.Random) -> tuple[str, str]:
    first = r.choice(FIRST)
    last = r.choice(LAST)
    user = r.choice((first.lower(), first.lower() + last.lower(), first.lower()[0] + last.lower()))
    addr = f"{user}@{r.choice(DOMAINS)}.com"
    text = r.choice((
        f"You can reach {first} at {addr} any time.",
        f"Contact: {first} {last}, {addr}",
        f"Send the files to {addr} before {r.choice(DAYS)}.",
        f"{first} {last} ({addr}) wants a call back.",
        f"My address is {addr}, thanks!",
    ))
    return f"Find the email address: {text}", addr


def _gen_sql(r: random.Random) -> tuple[str, str]:
    table = r.choice(sorted(SQL_TABLES))
    nums, texts = SQL_TABLES[table]
    cols = list(nums + texts)
    if r.random() < 0.2:
        sel, sel_text = "*", "everything"
    else:
        k = r.choice((1, 1, 2, 2, 3))
        chosen = r.sample(cols, k)
        sel = ", ".join(chosen)
        sel_text = chosen[0] if k == 1 else ", ".join(chosen[:-1]) + " and " + chosen[-1]
    prompt = f"Write SQL: list the {sel_text} of {table}" if sel != "*" else f"Write SQL: list everything in {table}"
    sql = f"SELECT {sel} FROM {table}"
    conds = []
    for _ in range(r.choice((0, 1, 1, 2))):
        if r.random() < 0.6:
            col = r.choice(nums)
            words, op = r.choice(SQL_OPS)
            val = str(r.randint(1, 500))
            conds.append((f"{col} {words} {val}", f"{col} {op} {val}"))
        else:
            col = r.choice(texts)
            val = r.choice(SQL_TEXT_VALUES[col])
            conds.append((f"{col} is {val}", f"{col} = '{val}'"))
    if conds:
        prompt += " where " + " and ".join(c[0] for c in conds)
        sql += " WHERE " + " AND ".join(c[1] for c in conds)
    if r.random() < 0.35:
        col = r.choice(cols)
        if r.random() < 0.5:
            prompt += f", sorted by {col}"
            sql += f" ORDER BY {col}"
        else:
            prompt += f", highest {col} first"
            sql += f" ORDER BY {col} DESC"
    if r.random() < 0.3:
        k = r.randint(1, 50)
        prompt += f", only {k}"
        sql += f" LIMIT {k}"
    return prompt, sql + ";"


def _gen_tool_call(r: random.Random) -> tuple[str, str]:
    kind = r.randrange(4)
    if kind == 0:
        city, unit = r.choice(CITIES), r.choice(("celsius", "fahrenheit"))
        ask = r.choice((f"what is the weather in {city} in {unit}?", f"{city} weather, in {unit} please",
                        f"how warm is it in {city}? Use {unit}."))
        call = {"name": "get_weather", "parameters": {"city": city, "unit": unit}}
    elif kind == 1:
        q = r.choice(QUERIES) + r.choice(("", f" in {r.choice(CITIES)}"))
        ask = r.choice((f"search the web for {q}", f"look up {q} online", f"find {q} on the internet"))
        call = {"name": "search_web", "parameters": {"query": q}}
    elif kind == 2:
        who, subj = f"{r.choice(FIRST)} {r.choice(LAST)}", r.choice(SUBJECTS)
        ask = r.choice((f"send an email to {who} about {subj}", f"email {who} regarding {subj}",
                        f"write to {who} about {subj} by email"))
        call = {"name": "send_email", "parameters": {"recipient": who, "subject": subj}}
    else:
        n = r.randint(1, 120)
        ask = r.choice((f"set a timer for {n} minutes", f"remind me in {n} minutes", f"start a {n} minute timer"))
        call = {"name": "set_timer", "parameters": {"minutes": n}}
    return f"Call a tool for: {ask}", json.dumps(call)


def _gen_prose(r: random.Random) -> tuple[str, str]:
    name = r.choice(FIRST)
    kind = r.randrange(3)
    if kind == 0:
        day, hour = r.choice(DAYS), r.randint(1, 12)
        return (f"Write a short note to {name}: the meeting moved to {day} at {hour} o'clock.",
                f"Hi {name}, just a quick note: the meeting has moved to {day} at {hour} o'clock. See you there!")
    if kind == 1:
        gift = r.choice(GIFTS)
        return (f"Write a thank-you note to {name} for the {gift}.",
                f"Dear {name}, thank you so much for the lovely {gift}. It really made my day!")
    city = r.choice(CITIES)
    return (f"Write a postcard to {name} from {city}.",
            f"Dear {name}, greetings from {city}! The weather is fine and the food is great. Wish you were here.")


_GENERATORS = {
    "json_extraction": _gen_json_extraction, "order_id": _gen_order_id, "year": _gen_year, "email": _gen_email,
    "sql": _gen_sql, "tool_call": _gen_tool_call, "prose": _gen_prose,
}
_SEED = 20261121


def split_of(prompt: str) -> str:
    """Which split a prompt belongs to (a content hash, so train and eval can never share a prompt)."""
    return "eval" if hashlib.sha256(prompt.encode("utf-8")).digest()[0] % 10 == 0 else "train"


@lru_cache(maxsize=64)
def _examples(workload: str, split: str, n: int) -> tuple[Example, ...]:
    gen = _GENERATORS[workload]
    r = random.Random(f"{_SEED}/{workload}/{split}")
    spec = constraint(workload)
    seen: set[str] = set()
    out: list[Example] = []
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 200 * n + 10000:
            raise ValueError(f"cannot draw {n} distinct {split} examples of {workload}")
        prompt, ref = gen(r)
        if prompt in seen or split_of(prompt) != split:
            continue
        seen.add(prompt)
        out.append(Example(workload, prompt, spec, ref))
    return tuple(out)


def examples(workload: str, split: str = "eval", n: int | None = None) -> list[Example]:
    """``n`` examples of ``workload`` from ``split`` ("train" | "eval"); deterministic, splits disjoint.

    ``n=None`` gives the default size (3000 train, 50 eval); smaller ``n`` gives a prefix of larger ones.
    """
    if workload not in _GENERATORS:
        raise KeyError(f"unknown workload {workload!r}; expected one of {', '.join(WORKLOADS)}")
    if split not in SPLITS:
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    n = DEFAULT_N[split] if n is None else int(n)
    if n <= DEFAULT_N[split]:
        return list(_examples(workload, split, DEFAULT_N[split])[:n])
    return list(_examples(workload, split, n))


__all__ = ["EOS", "Example", "STRUCTURED", "WORKLOADS", "chat_prompt", "constraint", "examples", "is_valid",
           "split_of", "training_text"]
