"""User agent code written against the `openai` client, driven by the `openai` agent loop in the tests."""

import json

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate arithmetic.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


async def calculator_agent(client, sample):
    """Ask, run the calculator calls the model makes (eval of digits and + only), ask again; return the answer."""
    messages = list(sample.messages)
    reply = (await client.chat.completions.create(model="megarl", messages=messages, tools=[CALCULATOR])).choices[0]
    messages.append(reply.message.model_dump(exclude_none=True))
    for call in reply.message.tool_calls or []:
        expression = json.loads(call.function.arguments)["expression"]
        value = sum(int(part) for part in expression.split("+"))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": str(value)})
    final = (await client.chat.completions.create(model="megarl", messages=messages, tools=[CALCULATOR])).choices[0]
    return final.message.content


def sync_agent(client, sample):
    return client.chat.completions.create(model="megarl", messages=sample.messages).choices[0].message.content
