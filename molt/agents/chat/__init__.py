"""ChatAgent and the chat server: any OpenAI/Anthropic-SDK program drives the policy, captured token-exactly.

`agent.py` (ChatAgent, ChatContext, ChatRunner), `server.py` (HTTP), `session.py` (capture, no HTTP),
`wire_openai.py` / `wire_anthropic.py` (the two wires), `tool_parser.py` (per template family);
`molt serve` is `molt/cli/serve.py`. Knows the engine interface and tokenizer, not the trainer."""

from molt.agents.chat.agent import ChatAgent, ChatContext, ChatRunner, load_agent_class
from molt.agents.chat.replies import TurnReply
from molt.agents.chat.server import ChatServer
from molt.agents.chat.session import Session
from molt.agents.env import Result

__all__ = ["ChatAgent", "ChatContext", "ChatRunner", "ChatServer", "Result", "Session", "TurnReply", "load_agent_class"]
