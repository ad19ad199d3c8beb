"""A headless Debug Adapter Protocol client over a plain socket (what VS Code speaks to
debugpy), for the debugger tests."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time
from typing import Any

PAUSED = re.compile(r"\[debug\] (\w+) rank (\d+) paused at (\S+):(\d+); attach to ([\w.]+):(\d+)")


class DAPClient:
    def __init__(self, host: str, port: int, timeout_s: float = 60.0):
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self.buf = b""
        self.seq = 0
        self.events: list[dict] = []

    def send(self, command: str, **arguments: Any) -> int:
        self.seq += 1
        body = json.dumps(
            {"seq": self.seq, "type": "request", "command": command, "arguments": arguments}
        ).encode()
        self.sock.sendall(b"Content-Length: %d\r\n\r\n" % len(body) + body)
        return self.seq

    def _read(self) -> dict:
        while b"\r\n\r\n" not in self.buf:
            self.buf += self._recv()
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        length = int(re.search(rb"Content-Length: (\d+)", head).group(1))
        while len(self.buf) < length:
            self.buf += self._recv()
        body, self.buf = self.buf[:length], self.buf[length:]
        return json.loads(body)

    def _recv(self) -> bytes:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("debug adapter closed the connection")
        return data

    def response(self, seq: int) -> dict:
        while True:
            msg = self._read()
            if msg["type"] == "event":
                self.events.append(msg)
            elif msg["type"] == "response" and msg["request_seq"] == seq:
                assert msg["success"], msg
                return msg.get("body", {})

    def request(self, command: str, **arguments: Any) -> dict:
        return self.response(self.send(command, **arguments))

    def event(self, name: str) -> dict:
        for i, e in enumerate(self.events):
            if e["event"] == name:
                return self.events.pop(i).get("body", {})
        while True:
            msg = self._read()
            if msg["type"] == "event" and msg["event"] == name:
                return msg.get("body", {})
            if msg["type"] == "event":
                self.events.append(msg)

    def attach(self) -> dict:
        """initialize -> attach -> setExceptionBreakpoints -> configurationDone; returns
        the ``stopped`` event."""
        self.request("initialize", adapterID="polyrl-test", linesStartAt1=True, pathFormat="path")
        attach = self.send("attach", justMyCode=False)
        self.event("initialized")
        self.request("setExceptionBreakpoints", filters=["uncaught"])  # VS Code's default
        self.request("configurationDone")
        self.response(attach)
        return self.event("stopped")

    def top_frame(self, thread_id: int) -> dict:
        return self.request("stackTrace", threadId=thread_id, levels=1)["stackFrames"][0]

    def local_variables(self, frame_id: int) -> dict[str, str]:
        scopes = self.request("scopes", frameId=frame_id)["scopes"]
        ref = scopes[0]["variablesReference"]  # "Locals"
        return {
            v["name"]: v["value"]
            for v in self.request("variables", variablesReference=ref)["variables"]
        }

    def evaluate(self, expression: str, frame_id: int) -> str:
        return self.request("evaluate", expression=expression, frameId=frame_id, context="repl")[
            "result"
        ]

    def close(self) -> None:
        try:
            self.request("disconnect", terminateDebuggee=False)
        finally:
            self.sock.close()


def wait_for_pause(proc: subprocess.Popen, seen: list[str], timeout_s: float) -> re.Match:
    """Read ``proc``'s output lines (kept in ``seen``) until a ``[debug] ... paused`` line."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        seen.append(line)
        match = PAUSED.search(line)
        if match:
            print(line, end="", flush=True)  # the pause line, for the record (pytest -s)
            return match
    raise AssertionError("no [debug] pause line; output:\n" + "".join(seen[-60:]))
