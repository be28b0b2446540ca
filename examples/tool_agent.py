"""A multi-turn tool-using ChatAgent: the OpenAI SDK's tool-calling loop on the built-in calculator task.

    molt train --rollout.agent examples/tool_agent.py --chat.no_render_tools

The policy calls `calculate` (the server parses its `<tool_call>` text into `tool_calls`), this
program runs the tool and sends the result back as a `tool` message, until the policy answers.
All turns land in one trajectory: the policy's tokens exactly as generated, tool results as
prompt. `--chat.no_render_tools` because the built-in policy was warm-started on calculator
demonstrations without a tool list in its prompt; drop it for a model that expects one (e.g. Qwen).
"""

import json

from molt.agents.chat import ChatAgent, ChatContext, Result
from molt.data.tasks import calculate

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate `a op b` for non-negative integers and op in + - *.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


class CalculatorAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        messages, num_calls, answer = list(ctx.messages), 0, ""
        client = ctx.openai()  # bound to this rollout's session, on the runner's shared connection pool
        for _ in range(ctx.limits.max_turns):
            response = await client.chat.completions.create(model=ctx.model, messages=messages, tools=[CALCULATOR])
            message = response.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                answer = message.content or ""
                break
            for call in message.tool_calls:
                expression = json.loads(call.function.arguments).get("expression", "")
                messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(str(expression))})
                num_calls += 1
        score = float(answer.strip() == ctx.label)
        return Result(reward=score, score=score, truncated=not answer, info={"tool_calls": num_calls})
