"""A minimal ChatAgent on the Anthropic SDK (Messages API), streaming the reply.

    molt train --data.task arithmetic --rollout.agent examples/anthropic_agent.py

`ctx.session_url` is this rollout's session on Molt's chat server; the SDK appends `/v1/messages`.
"""

from anthropic import AsyncAnthropic

from molt.agents.chat import ChatAgent, ChatContext, Result


class ArithmeticAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        client = AsyncAnthropic(base_url=ctx.session_url, api_key=ctx.api_key)
        async with client, client.messages.stream(model=ctx.model, max_tokens=32, messages=ctx.messages) as stream:
            message = await stream.get_final_message()
        answer = "".join(block.text for block in message.content if block.type == "text")
        score = float(answer.strip() == ctx.label)
        return Result(reward=score, score=score, info={"output_tokens": message.usage.output_tokens})
