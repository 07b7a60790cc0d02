"""The official openai client's structured output and tool calls against `arbor serve`
(run by tests/serve/structured.rs).

usage: openai_tools_client.py BASE_URL MODEL
"""
import json
import sys

import openai
import pydantic

base_url, model = sys.argv[1:3]
client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
messages = [{"role": "user", "content": "Weather in Oslo?"}]


class Person(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=6)
    ok: bool


# The client's own structured-output helper: a pydantic model in, a parsed object out.
r = client.chat.completions.parse(
    model=model, messages=messages, response_format=Person, max_tokens=120, temperature=0.8, seed=3
)
person = r.choices[0].message.parsed
assert isinstance(person, Person) and len(person.name) <= 6, r
print("parsed:", person.model_dump_json())

tools = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                   "required": ["city"], "additionalProperties": False}}}]
forced = {"type": "function", "function": {"name": "get_weather"}}
r = client.chat.completions.create(
    model=model, messages=messages, tools=tools, tool_choice=forced, max_tokens=120, temperature=0.8, seed=4
)
choice = r.choices[0]
assert choice.finish_reason == "tool_calls", r
call = choice.message.tool_calls[0]
args = json.loads(call.function.arguments)
assert call.type == "function" and call.function.name == "get_weather" and len(args["city"]) <= 8, r
print("call:", call.function.name, call.function.arguments)

# Streamed: the client assembles the call from `delta.tool_calls`.
name, arguments, finish = None, "", None
for chunk in client.chat.completions.create(
    model=model, messages=messages, tools=tools, tool_choice=forced, max_tokens=120, temperature=0.8, seed=4,
    stream=True,
):
    if not chunk.choices:
        continue
    d = chunk.choices[0].delta
    for tc in d.tool_calls or []:
        assert tc.index == 0, chunk
        name = tc.function.name or name
        arguments += tc.function.arguments or ""
    finish = chunk.choices[0].finish_reason or finish
assert (name, arguments, finish) == ("get_weather", call.function.arguments, "tool_calls"), (name, arguments, finish)

# The next turn: the assistant's call and the tool's answer.
follow = messages + [
    {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
    {"role": "tool", "tool_call_id": call.id, "content": "{\"temp\": 4}"},
]
r = client.chat.completions.create(model=model, messages=follow, tools=tools, max_tokens=4, temperature=0)
assert r.choices[0].message is not None, r
print("openai tools client: all checks passed")
