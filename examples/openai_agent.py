"""A minimal ChatAgent: one OpenAI-SDK chat completion per rollout, graded against the row's label.

    molt train --data.task arithmetic --rollout.agent examples/openai_agent.py

The SDK talks to Molt's loopback chat server (`ctx.base_url`), which records the exact tokens the
policy generated; the reward returned here trains them.
"""

from openai import AsyncOpenAI

from molt.agents.chat import ChatAgent, ChatContext, Result


class ArithmeticAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key) as client:
            response = await client.chat.completions.create(model=ctx.model, messages=ctx.messages)
        answer = response.choices[0].message.content or ""
        score = float(answer.strip() == ctx.label)
        return Result(reward=score, score=score)
