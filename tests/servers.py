"""The real servers the tests start themselves: an MCP server over stdio, and a throwaway PostgreSQL.
"""

import asyncio
import functools
import glob
import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script: the root
import agent_loop  # noqa: E402


def mcp_server():
    """A real MCP server, written with the official package: the SDK lane's tests run it over stdio."""
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError
    from mcp.types import ToolAnnotations

    server = MCPServer("inventory-test", log_level="WARNING")  # quiet about the isError results it sends
    stock = {"A-1": 12, "B-2": 0}

    @server.tool()
    def read_stock(sku: str) -> dict[str, int]:
        """Stock of one sku."""
        return {"stock": stock.get(sku, 0)}

    @server.tool()
    def lookup(code: str) -> str:
        """Country of a two-letter code."""
        if code != "FR":
            raise ToolError(f"unknown code {code!r}")
        return "France"

    @server.tool()
    async def slow(seconds: float) -> str:
        """Sleeps."""
        if "MCP_STARTED" in os.environ:
            open(os.environ["MCP_STARTED"], "w").close()
        await asyncio.sleep(seconds)
        return "slept"

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    def write_note(text: str) -> str:
        """Appends a note, though it hints that it only reads."""
        with open(os.environ.get("MCP_NOTES", "notes.txt"), "a") as notes:
            notes.write(text)
        return "ok"

    if "MCP_PIDFILE" in os.environ:
        with open(os.environ["MCP_PIDFILE"], "w") as pidfile:
            pidfile.write(str(os.getpid()))
    server.run()


def mcp_lowlevel_server():
    """A low-level MCP server, written with the official package's Server: each tool declares an outputSchema, and
    two break it, one answering off it, one without structuredContent; the SDK lane's tests run it over stdio."""
    import anyio
    import mcp.types as types
    from mcp.server.lowlevel import Server
    from mcp.server.stdio import stdio_server

    stock = {"type": "object", "properties": {"sku": {"type": "string"}, "stock": {"type": "integer"}},
             "required": ["sku", "stock"], "additionalProperties": False}
    sku = {"type": "object", "properties": {"sku": {"type": "string"}}, "required": ["sku"]}
    answers = {  # a tool: its result
        "well": {"sku": "A-1", "stock": 12},
        "off_schema": {"sku": "A-1", "stock": "a private count"},
        "unstructured": None,
    }

    async def list_tools(context, params):
        return types.ListToolsResult(tools=[types.Tool(name=name, description=f"Stock, {name}.", input_schema=sku,
                                                       output_schema=stock) for name in answers])

    async def call_tool(context, params):
        answer = answers[params.name]
        text = types.TextContent(type="text", text=json.dumps(answer or {"sku": "A-1", "stock": 12}))
        return types.CallToolResult(content=[text], structured_content=answer)

    server = Server("results-test", on_list_tools=list_tools, on_call_tool=call_tool)

    async def main():
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())

    anyio.run(main)


def postgres_binaries():
    """The folder of initdb and pg_ctl, or SkipTest saying what is missing."""
    try:
        import psycopg  # noqa: F401  (test-only: the SDK lane installs it)
    except ImportError:
        raise unittest.SkipTest("psycopg 3 is not installed (the SDK lane installs it)") from None
    folders = [os.path.dirname(shutil.which("initdb") or ""), *sorted(glob.glob("/usr/lib/postgresql/*/bin"))[::-1]]
    for folder in filter(None, folders):
        if all(os.access(os.path.join(folder, name), os.X_OK) for name in ("initdb", "pg_ctl")):
            return folder
    raise unittest.SkipTest("PostgreSQL's initdb and pg_ctl are not installed")


class ThrowawayPostgres:
    """A PostgreSQL server in a folder of its own: started, then stopped and removed, even if the tests are killed
    (a watchdog process does it when the pipe from this process closes)."""

    def __init__(self, durable=False):
        binaries = postgres_binaries()
        self.as_server = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self.as_server and not shutil.which("runuser"):
            raise unittest.SkipTest("running as root without runuser: PostgreSQL will not run as root")
        self.folder = tempfile.mkdtemp(prefix="agent_loop_pg_")
        self.pg_ctl, data = os.path.join(binaries, "pg_ctl"), os.path.join(self.folder, "data")
        stop = [*self.as_server, self.pg_ctl, "stop", "-D", data, "-m", "immediate", "-w"]
        watchdog = f"import shutil, subprocess, sys; sys.stdin.read(); subprocess.run({stop!r}, capture_output=True); " \
                   f"shutil.rmtree({self.folder!r}, True)"
        self.watchdog = subprocess.Popen([sys.executable, "-c", watchdog], stdin=subprocess.PIPE,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            if self.as_server:
                shutil.chown(self.folder, "postgres", "postgres")
            self.run(os.path.join(binaries, "initdb"), "-D", data, "-U", "postgres", "--auth=trust", "-E", "UTF8",
                     "--locale=C", "--no-sync")
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                self.port = probe.getsockname()[1]
            with open(os.path.join(data, "postgresql.auto.conf"), "w") as conf:
                conf.write(f"listen_addresses = '127.0.0.1'\nport = {self.port}\nunix_socket_directories = "
                           f"'{self.folder}'\nmax_connections = 40\n" + ("" if durable else "fsync = off\n"))
            self.run(self.pg_ctl, "start", "-D", data, "-w", "-t", "60", "-l", os.path.join(self.folder, "log"))
        except BaseException:
            self.stop()
            raise
        self.conninfo = f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres connect_timeout=10"

    def run(self, *command):
        subprocess.run([*self.as_server, *command], cwd=self.folder, capture_output=True, check=True, timeout=120)

    def stop(self):
        self.watchdog.stdin.close()  # the watchdog stops the server and removes the folder
        self.watchdog.wait(timeout=60)


def postgres_connection(conninfo, schema):
    """A psycopg connection, in autocommit, whose tables are the schema's: a place for bench's figures."""
    import psycopg
    connection = psycopg.connect(conninfo, autocommit=True)
    connection.execute(f"SET search_path TO {schema}")
    return connection


def bench_beside_postgres(argv):
    """python3 tests/servers.py bench [--quick] [--json]: agent_loop's bench, on a PostgreSQL server of its own
    too (fsync on, as a server that keeps what it commits), started and removed as the tests' is."""
    import psycopg
    from benchmarks import bench  # what it runs: the bench, beside the project's module
    server, schemas = ThrowawayPostgres(durable=True), itertools.count()

    def place():
        schema = f"bench_{next(schemas)}"
        with psycopg.connect(server.conninfo, autocommit=True) as admin:
            admin.execute(f"CREATE SCHEMA {schema}")
        return functools.partial(postgres_connection, server.conninfo, schema)

    try:
        bench.BENCH_POSTGRES.append(place)
        return bench.main(argv)
    finally:
        server.stop()


if __name__ == "__main__" and sys.argv[1:2] == ["bench"]:
    raise SystemExit(bench_beside_postgres(sys.argv[2:]))
