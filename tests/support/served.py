"""An app served by uvicorn in a thread of this process, on a port the OS picked."""

from __future__ import annotations

import socket
import threading

import uvicorn
from fastapi import FastAPI

from support.polling import wait_for


def serve(app: FastAPI, sock: socket.socket) -> tuple[uvicorn.Server, threading.Thread, str]:
    """``app`` under uvicorn in a thread, on a loopback port the OS picked."""
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app, lifespan="on", log_config=None, access_log=False, timeout_graceful_shutdown=5
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True
    )
    thread.start()
    wait_for(lambda: server.started or not thread.is_alive(), "uvicorn to start")
    assert server.started, "uvicorn stopped during start-up (see the log)"
    return server, thread, f"http://127.0.0.1:{port}"
