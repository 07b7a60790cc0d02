"""One chat question to `arbor serve` through the official openai client (tests/smollm2.rs;
the README shows its output).

usage: openai_chat.py BASE_URL MODEL QUESTION
Prints one JSON line: the answer, its finish reason and arbor's token ids.
"""
import json
import sys

import openai

base_url, model, question = sys.argv[1:4]
client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
r = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": question}],
    max_tokens=48,
    temperature=0,
)
c = r.choices[0]
print(json.dumps({"content": c.message.content, "finish_reason": c.finish_reason,
                  "token_ids": c.model_extra["token_ids"]}))
