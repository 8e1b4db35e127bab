"""The benchmarked server's process: `specdec serve` started on a free loopback port, waited for
until /health answers, and stopped gracefully."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_command(args: argparse.Namespace, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "specdec.cli",
        "serve",
        *([args.serve] if args.serve else []),  # none: the built-in model
        "--port",
        str(port),
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--threads",
        str(args.threads),
        *(
            ["--no-spec"]
            if getattr(args, "no_spec_now", False)
            else ["--speculative-config", json.dumps(args.speculative_config)]
            if args.speculative_config is not None
            else []  # the server's own default
        ),
        *args.serve_arg,
    ]


def start_server(args: argparse.Namespace, log_path: Path) -> subprocess.Popen:
    """Starts `specdec serve` and waits until /health answers (or the process dies)."""
    port = free_port()
    args.url = f"http://127.0.0.1:{port}"
    command = serve_command(args, port)
    args.serve_command = command
    print("starting:", " ".join(command), flush=True)
    log = log_path.open("wb")
    env = dict(os.environ)
    source = getattr(args, "server_src", None)
    if source:  # another revision's engine (ab_serve.py) serves; this process's drives it
        env["PYTHONPATH"] = os.pathsep.join(p for p in (source, env.get("PYTHONPATH")) if p)
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    log.close()
    started = time.monotonic()
    deadline = started + args.startup_timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            tail = log_path.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"specdec serve exited with {server.returncode}:\n{tail}")
        try:
            if httpx.get(f"{args.url}/health", timeout=2.0).status_code == 200:
                args.startup_seconds = round(time.monotonic() - started, 1)
                print(f"ready: /health answered 200 after {args.startup_seconds} s", flush=True)
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(server)
    raise TimeoutError(f"specdec serve did not answer /health within {args.startup_timeout_s} s")


def stop_server(server: subprocess.Popen) -> None:
    """SIGINT (uvicorn's graceful shutdown), then SIGKILL if it lingers."""
    if server.poll() is not None:
        return
    server.send_signal(signal.SIGINT)
    try:
        server.wait(60)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
