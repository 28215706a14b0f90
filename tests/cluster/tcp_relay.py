"""An ssh ProxyCommand: `python tcp_relay.py HOST PORT` joins stdin/stdout to a TCP connection.

Ray's cluster launcher has no SSH port option (auth: ssh_user, ssh_private_key, ssh_proxy_command, ...), so
the ray-up test reaches its own sshd on a free loopback port through this relay."""
from __future__ import annotations

import os
import socket
import sys
import threading


def _pump_stdin(sock: socket.socket) -> None:
    while data := os.read(0, 65536):
        sock.sendall(data)
    sock.shutdown(socket.SHUT_WR)


def main(host: str, port: int) -> int:
    sock = socket.create_connection((host, port))
    threading.Thread(target=_pump_stdin, args=(sock,), daemon=True).start()
    while data := sock.recv(65536):
        view = memoryview(data)
        while view:
            view = view[os.write(1, view):]
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
