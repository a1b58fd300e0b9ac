"""A small MCP server made with the `mcp` package, for tests/tools/.

`server.py http PORT TOKEN`: Streamable HTTP on 127.0.0.1:PORT at /mcp, refusing requests
without `Authorization: Bearer TOKEN`. `server.py stdio`: the same tools over stdio.
"""

import asyncio
import os
import sys

from mcp.server.mcpserver import Context, MCPServer

server = MCPServer("dispatch-test")


@server.tool()
def shout(text: str) -> str:
    """The text in capitals."""
    return text.upper()


@server.tool()
async def slow(seconds: float, ctx: Context) -> str:
    """Sleeps, saying how far it got ten times a second."""
    steps = max(1, int(seconds * 10))
    try:
        for i in range(steps):
            await ctx.report_progress(i + 1, steps, f"step {i + 1} of {steps}")
            await asyncio.sleep(seconds / steps)
    except asyncio.CancelledError:
        # The client's `notifications/cancelled` arrived: say so where the test looks.
        marker = os.environ.get("DISPATCH_TEST_MCP_CANCELLED")
        if marker:
            with open(marker, "w") as f:
                f.write("cancelled")
        raise
    return f"slept {seconds} s"


@server.tool()
def big(size: int) -> str:
    """`size` bytes of text."""
    return "x" * size


@server.tool()
async def grow(ctx: Context) -> str:
    """Adds the tool `grown` and tells the client its tools changed."""

    def grown() -> str:
        """A tool that was not there at first."""
        return "grown"

    server.add_tool(grown)
    await ctx.request_context.session.send_tool_list_changed()
    return "added grown"


@server.tool()
def environment() -> str:
    """The server's environment, one NAME=value a line."""
    return "\n".join(f"{k}={v}" for k, v in sorted(os.environ.items()))


@server.tool()
def crash() -> str:
    """Ends the server's process at once."""
    os._exit(3)


def guarded(app, token):
    """The app behind a bearer token check."""

    async def asgi(scope, receive, send):
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or [])
            if headers.get(b"authorization") != f"Bearer {token}".encode():
                await send({"type": "http.response.start", "status": 401, "headers": [(b"content-type", b"text/plain")]})
                await send({"type": "http.response.body", "body": b"no token"})
                return
        await app(scope, receive, send)

    return asgi


if __name__ == "__main__":
    # Where the test looks for this process, to see it gone once the gateway stops.
    if os.environ.get("DISPATCH_TEST_MCP_PIDFILE"):
        with open(os.environ["DISPATCH_TEST_MCP_PIDFILE"], "w") as f:
            f.write(str(os.getpid()))
    if sys.argv[1] == "stdio":
        server.run("stdio")
    else:
        import uvicorn

        port, token = int(sys.argv[2]), sys.argv[3]
        app = guarded(server.streamable_http_app(), token)
        uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
