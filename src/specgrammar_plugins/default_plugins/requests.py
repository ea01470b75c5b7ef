"""The built-in request parser: the OpenAI / vLLM / llama-cpp-python spellings (``requests.parse_openai``)."""

from __future__ import annotations

from ..hookspecs import hookimpl
from ..requests import parse_openai


@hookimpl
def register_request_parsers(register):
    register("openai", parse_openai)


