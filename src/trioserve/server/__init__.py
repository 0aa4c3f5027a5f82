"""The HTTP and WebSocket server: the OpenAI-compatible API, WebSocket token streaming, /metrics and
/health on one port (``trioserve serve``; docs/openai-api.md, docs/websocket-protocol.md)."""

from trioserve.server.config import ServerConfig
from trioserve.server.server import Server

__all__ = ["Server", "ServerConfig"]
