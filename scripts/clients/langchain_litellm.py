#!/usr/bin/env python3
"""LangChain (`bind_tools`, `with_structured_output`) and LiteLLM (`completion` with tools
and `response_format`) against a running `arbor serve`, unmodified: the clients' own
calls, checked for what they read back.

usage: python3 scripts/clients/langchain_litellm.py http://127.0.0.1:8000/v1 MODEL
(python3 -m pip install langchain-openai litellm). Prints each result; exits 1 on the
first check that fails.
"""

from __future__ import annotations

import json
import sys

import pydantic


class Weather(pydantic.BaseModel):
    """The weather in a city."""

    model_config = pydantic.ConfigDict(extra="forbid")
    city: str = pydantic.Field(max_length=8)
    celsius: int = pydantic.Field(ge=-40, le=50)


def langchain(base_url: str, model: str) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    class City(pydantic.BaseModel):
        # A bound keeps a random test model's string short.
        city: str = pydantic.Field(max_length=8)

    @tool(args_schema=City)
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    llm = ChatOpenAI(
        base_url=base_url,
        api_key="none",
        model=model,
        temperature=0.7,
        seed=3,
        max_tokens=200,
    )
    ask = "What is the weather in Oslo?"
    msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(ask)
    print("langchain bind_tools:", msg.tool_calls)
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather", msg
    assert isinstance(msg.tool_calls[0]["args"].get("city"), str), msg
    for method in ("json_schema", "function_calling"):
        w = llm.with_structured_output(Weather, method=method).invoke(ask)
        print(f"langchain with_structured_output({method}):", repr(w))
        assert isinstance(w, Weather), w


def litellm_calls(base_url: str, model: str) -> None:
    import litellm

    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 8}},
                    "required": ["city"],
                    "additionalProperties": False,
                },
            },
        }
    ]
    common = {
        "model": f"openai/{model}",
        "api_base": base_url,
        "api_key": "none",
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "max_tokens": 200,
        "temperature": 0.7,
        "seed": 4,
    }
    r = litellm.completion(**common, tools=tools, tool_choice="required")
    call = r.choices[0].message.tool_calls[0]
    print("litellm tools:", call.function.name, call.function.arguments)
    assert call.function.name == "get_weather" and "city" in json.loads(
        call.function.arguments
    )
    r = litellm.completion(**common, response_format=Weather)
    w = Weather.model_validate_json(r.choices[0].message.content)
    print("litellm response_format:", repr(w))


def main() -> int:
    base_url, model = sys.argv[1:3]
    langchain(base_url, model)
    litellm_calls(base_url, model)
    print("langchain + litellm: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
