"""The official openai client against `arbor serve` (run by tests/serve/api.rs).

usage: openai_client.py BASE_URL API_KEY MODEL
"""
import sys

import openai

base_url, api_key, model = sys.argv[1:4]
client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)

models = client.models.list()
assert [m.id for m in models.data] == [model], models

# Completions from token ids; arbor's extensions arrive as extra fields.
req = {"model": model, "prompt": [1, 2, 3, 4], "max_tokens": 5, "temperature": 0.7, "seed": 5,
       "logprobs": 0}
c = client.completions.create(**req)
choice = c.choices[0]
ids = choice.model_extra["token_ids"]
assert len(ids) == 5 and c.usage.completion_tokens == 5, c
assert len(choice.logprobs.token_logprobs) == 5, choice.logprobs
assert len(choice.model_extra["logits_digest"]) == 5
print("tokens:", ids)

# The same request again, and streamed: the same tokens.
again = client.completions.create(**req)
assert again.choices[0].model_extra["token_ids"] == ids
streamed = []
text = ""
for chunk in client.completions.create(stream=True, **req):
    for ch in chunk.choices:
        streamed += ch.model_extra.get("token_ids") or []
        text += ch.text or ""
assert streamed == ids, (streamed, ids)
assert text == choice.text, (text, choice.text)

# Text prompt, n choices, prompt log-probs (the scoring path) via extra_body.
c = client.completions.create(model=model, prompt="Hello", max_tokens=3, n=2, temperature=1.0,
                              extra_body={"prompt_logprobs": True, "top_k": 5})
assert len(c.choices) == 2
assert len(c.choices[0].model_extra["prompt_logprobs"]) == len(c.choices[0].model_extra["prompt_token_ids"]) - 1

# Chat, plain and streamed.
msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
chat = client.chat.completions.create(model=model, messages=msgs, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
assert chat.choices[0].message.role == "assistant"
assert len(chat.choices[0].logprobs.content) == len(chat.choices[0].model_extra["token_ids"])
parts = []
for chunk in client.chat.completions.create(model=model, messages=msgs, max_tokens=4, temperature=0, stream=True):
    for ch in chunk.choices:
        parts.append(ch.delta.content or "")
assert "".join(parts) == chat.choices[0].message.content, (parts, chat.choices[0].message.content)

# Errors surface as the client's typed exceptions.
try:
    client.completions.create(model=model, prompt=[1], temperature=-1)
    raise SystemExit("temperature -1 was accepted")
except openai.BadRequestError as e:
    assert e.status_code == 400 and "temperature" in str(e), e
try:
    client.completions.create(model="no-such-model", prompt=[1])
    raise SystemExit("an unknown model was accepted")
except openai.NotFoundError as e:
    assert e.status_code == 404, e
bad = openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0)
try:
    bad.models.list()
    raise SystemExit("a wrong API key was accepted")
except openai.AuthenticationError as e:
    assert e.status_code == 401, e

print("openai client: all checks passed")
