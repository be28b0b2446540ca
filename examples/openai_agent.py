"""A minimal ChatAgent: one OpenAI-SDK chat completion per rollout, graded against the row's label.

    molt train --data.task arithmetic --rollout.agent examples/openai_agent.py

`ctx.openai()` is an `AsyncOpenAI` client bound to this rollout's session on Molt's loopback chat
server, which records the exact tokens the policy generated; the reward returned here trains them.
It shares one connection pool with every other rollout (building `AsyncOpenAI(base_url=ctx.base_url,
api_key=ctx.api_key)` per rollout works too, but pays ~20-90 ms of TLS set-up each time).
"""

from molt.agents.chat import ChatAgent, ChatContext, Result


class ArithmeticAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        response = await ctx.openai().chat.completions.create(model=ctx.model, messages=ctx.messages)
        answer = response.choices[0].message.content or ""
        score = float(answer.strip() == ctx.label)
        return Result(reward=score, score=score)
