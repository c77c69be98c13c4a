"""A roll call before ``jax.distributed.initialize``: every process of the group reports to
process 0 on the coordinator's port, so that a process that never comes is named.

JAX's own join timeout aborts the process from C++ with ``DEADLINE_EXCEEDED`` and no word
on who is missing. This small TCP exchange runs first, on the very port the coordinator
will use (process 0 closes it again before JAX binds it):

* process 0 listens, reads one JSON line ``{"process_id", "num_processes", "host",
  "pid"}`` from each peer, checks ids and counts, and answers every peer with ``go`` or
  with the error it is about to raise itself;
* a peer connects (retrying until the deadline: process 0 may start later), sends its
  line and waits for the answer; it closes first, so the coordinator's port is left
  without ``TIME_WAIT`` connections.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Mapping

__all__ = ["ENV_LISTEN_FD", "inherited_listener", "listen", "roll_call", "split_address"]

_POLL_S = 0.2
# The listening socket of the roll call, bound by ``python -m blox.launch`` and handed to
# process 0 (so that no other program can take the port between its choice and its use).
ENV_LISTEN_FD = "BLOX_ROLL_CALL_FD"


def listen(port: int) -> socket.socket:
    """A TCP server socket on every address (IPv4 and IPv6 where the host has both) and
    `port` (0: a free one the OS picks)."""
    if socket.has_dualstack_ipv6():
        return socket.create_server(
            ("", port), family=socket.AF_INET6, dualstack_ipv6=True, reuse_port=False
        )
    return socket.create_server(("", port))


def inherited_listener(env: Mapping[str, str], port: int) -> socket.socket | None:
    """The listening socket the launcher handed over (``BLOX_ROLL_CALL_FD``) when it is
    one on `port`; None otherwise."""
    fd = env.get(ENV_LISTEN_FD, "")
    if not fd.isdigit():
        return None
    try:
        sock = socket.socket(fileno=int(fd))
    except OSError:
        return None
    try:
        ok = sock.getsockname()[1] == port and sock.type == socket.SOCK_STREAM
    except OSError:
        ok = False
    if not ok:
        sock.detach()  # not ours to close
        return None
    sock.set_inheritable(False)
    return sock


def split_address(address: str) -> tuple[str, int]:
    """``'host:port'`` (or ``'[v6]:port'``) -> ``(host, port)``; ValueError when malformed."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"coordinator address {address!r} is not 'host:port' (e.g. '10.0.0.1:1234' or "
            "'localhost:1234'); pass it as coordinator_address= or BLOX_COORDINATOR_ADDRESS."
        )
    return host.strip("[]"), int(port)


def _missing_text(missing: list[int], num_processes: int, timeout: float) -> str:
    names = ", ".join(str(i) for i in missing)
    plural = "es" if len(missing) > 1 else ""
    return (
        f"process{plural} {names} of {num_processes} did not join within {timeout:g} s. "
        f"Start every process 0..{num_processes - 1} with the same coordinator address and "
        "process count (python -m blox.launch does this on one machine), check that the "
        f"missing one{'s' if len(missing) > 1 else ''} did not fail before calling "
        "initialize(), or raise the timeout (initialization_timeout= or BLOX_INIT_TIMEOUT)."
    )


def _read_line(conn: socket.socket, deadline: float) -> bytes | None:
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        conn.settimeout(min(left, _POLL_S * 5))
        try:
            chunk = conn.recv(4096)
        except TimeoutError:
            continue
        if not chunk:
            return None
        data += chunk
    return data


def _serve(
    port: int, num_processes: int, timeout: float, listener: socket.socket | None = None
) -> None:
    deadline = time.monotonic() + timeout
    server = listener if listener is not None else listen(port)
    peers: dict[int, tuple[socket.socket, dict]] = {}
    error: str | None = None
    try:
        server.settimeout(_POLL_S)
        while len(peers) < num_processes - 1 and error is None:
            if time.monotonic() > deadline:
                missing = [i for i in range(1, num_processes) if i not in peers]
                error = _missing_text(missing, num_processes, timeout)
                break
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            line = _read_line(conn, min(deadline, time.monotonic() + 10.0))
            try:
                hello = json.loads(line or b"")
                pid, count = int(hello["process_id"]), int(hello["num_processes"])
            except (ValueError, KeyError, TypeError):
                conn.close()  # not one of ours (a port scanner, a stale client): ignore it
                continue
            if count != num_processes:
                error = (
                    f"process {pid} (host {hello.get('host')}) was started with "
                    f"num_processes={count} but process 0 with {num_processes}; start every "
                    "process with the same count."
                )
            elif not 0 < pid < num_processes:
                error = (
                    f"a process on host {hello.get('host')} says it is process {pid}, but the "
                    f"peers of process 0 are 1..{num_processes - 1}; give each process a "
                    "distinct id in 0..num_processes-1."
                )
            elif pid in peers:
                error = (
                    f"two processes say they are process {pid} (hosts "
                    f"{peers[pid][1].get('host')} pid {peers[pid][1].get('pid')} and "
                    f"{hello.get('host')} pid {hello.get('pid')}); give each process a "
                    "distinct id in 0..num_processes-1."
                )
            peers.setdefault(pid, (conn, hello))
            if pid in peers and peers[pid][0] is not conn:
                conn.sendall(json.dumps({"error": error}).encode() + b"\n")
                conn.close()
        answer = json.dumps({"error": error} if error else {"go": True}).encode() + b"\n"
        for conn, _ in peers.values():
            try:
                conn.sendall(answer)
            except OSError:
                pass
        # Let the peers close first (their side keeps TIME_WAIT), then free the port.
        for conn, _ in peers.values():
            _read_line(conn, time.monotonic() + 5.0)
    finally:
        for conn, _ in peers.values():
            conn.close()
        server.close()
    if error:
        raise TimeoutError(error) if "did not join" in error else ValueError(error)


def _join(host: str, port: int, process_id: int, num_processes: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    hello = {
        "process_id": process_id,
        "num_processes": num_processes,
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=_POLL_S * 5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"process {process_id}: process 0 (the coordinator, {host}:{port}) did not "
                    f"join within {timeout:g} s. "
                    + _missing_text([0], num_processes, timeout).split(". ", 1)[1]
                ) from None
            time.sleep(_POLL_S)
    with conn:
        conn.sendall(json.dumps(hello).encode() + b"\n")
        line = _read_line(conn, deadline + 15.0)
    if line is None:
        raise TimeoutError(
            f"process {process_id}: process 0 (the coordinator, {host}:{port}) accepted the "
            "connection but gave no answer (it stopped or timed out); see its output."
        )
    answer = json.loads(line)
    if answer.get("error"):
        text = f"process {process_id}: process 0 reports: {answer['error']}"
        raise TimeoutError(text) if "did not join" in text else ValueError(text)


def roll_call(
    address: str,
    process_id: int,
    num_processes: int,
    timeout: float,
    *,
    listener: socket.socket | None = None,
) -> None:
    """Returns once all `num_processes` processes have reported (ids 0..n-1, each once,
    all with the same count); raises TimeoutError naming the processes that did not come
    within `timeout` seconds, or ValueError for a duplicate id or a differing count.
    Process 0 serves on `listener` when given (a socket already listening on the port,
    closed on return), else binds the port itself."""
    host, port = split_address(address)
    if process_id == 0:
        _serve(port, num_processes, timeout, listener)
    else:
        if listener is not None:
            listener.close()
        _join(host, port, process_id, num_processes, timeout)
