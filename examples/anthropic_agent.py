"""A minimal ChatAgent on the Anthropic SDK (Messages API), streaming the reply.

    molt train --data.task arithmetic --rollout.agent examples/anthropic_agent.py

`ctx.anthropic()` is an `AsyncAnthropic` client bound to this rollout's session on Molt's chat server
(`ctx.session_url`; the SDK appends `/v1/messages`), sharing one connection pool with every rollout.
"""

from molt.agents.chat import ChatAgent, ChatContext, Result


class ArithmeticAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        client = ctx.anthropic()
        async with client.messages.stream(model=ctx.model, max_tokens=32, messages=ctx.messages) as stream:
            message = await stream.get_final_message()
        answer = "".join(block.text for block in message.content if block.type == "text")
        score = float(answer.strip() == ctx.label)
        return Result(reward=score, score=score, info={"output_tokens": message.usage.output_tokens})
