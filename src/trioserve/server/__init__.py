"""WebSocket token streaming: ``trioserve serve`` (docs/websocket-protocol.md)."""

from trioserve.server.config import ServerConfig
from trioserve.server.server import Server

__all__ = ["Server", "ServerConfig"]
