"""A process of a multi-process run that dies is named in one line by every survivor.

Without this, JAX's coordination service notices a dead process only when its heartbeat
has been missing for ``heartbeat_timeout_seconds`` (100 s) and then aborts every survivor
with an absl FATAL and a C++ stack dump; the survivors' collectives fail earlier with a
Python traceback that names no process; and a dead coordinator (process 0) aborts the
others at once, again with the dump.

The watch is a TCP connection from every process to process 0 (a star, so N - 1
connections in all). The kernel closes a process's sockets when it ends in any way (a
crash, SIGKILL, the OOM killer), so the other end reads end-of-file at once; TCP keepalive
probes find a host that went silent (powered off, cut from the network) within
``SILENT_HOST_S``. A process that ends deliberately (whatever its exit status) first says
``bye``, so a normal finish, in which processes end a little apart, is never reported:

- process 0 reads end-of-file from process k without a ``bye``: it tells the others
  ``lost k``, prints its line and exits;
- any other process reads ``lost k`` (process k died) or end-of-file from process 0
  without a ``bye`` (the coordinator died): it prints its line and exits.

Each exits with ``os._exit(exit_code)`` before JAX's own abort fires, so its stderr holds
the one line and no traceback (lp_jax.parallel.stderr_relay drops the lines XLA's
coordination client may write in the same millisecond as a dead coordinator). A process
hung but alive (stopped, deadlocked) keeps its sockets open: JAX's heartbeat still finds it.
"""
from __future__ import annotations

import os
import selectors
import socket
import sys
import threading
import time
from typing import Callable

KEY = "lp-jax-peer-watch"  # process 0's host:port in the coordination service's key-value store
CONNECT_TIMEOUT_S = 60.0  # how long the others wait for process 0 to publish its address
SILENT_HOST_S = 30  # keepalive: idle 10 s, then 4 probes 5 s apart
SETTLE_S = 5.0  # a failed collective waits this long for the watch to name a dead process
DRAIN_S = 2.0  # process 0 lets the others read "lost k" and leave before it exits itself


class PeerWatch:
    """Started by ``start`` after ``jax.distributed.initialize``; ``bye()`` when the process
    ends deliberately; ``settle()`` when the main thread's work failed."""

    def __init__(self, index: int, count: int, exit_code: int,
                 before_exit: Callable[[], None] = lambda: None, say=None):
        self.index, self.count, self.exit_code = index, count, exit_code
        self.before_exit = before_exit  # e.g. tells the stderr relay to drop XLA's lines
        self._say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self.lost = threading.Event()
        self._leaving = False  # this process said bye
        self._lock = threading.Lock()
        self._peers: dict[socket.socket, int | None] = {}  # process 0: connection -> index
        self._coordinator: socket.socket | None = None  # the others: the link to process 0

    # -- the main thread ---------------------------------------------------------------

    def bye(self) -> None:
        """This process ends deliberately: nobody reports it, and it reports no one after."""
        with self._lock:
            self._leaving = True
            links = list(self._peers) if self.index == 0 else [self._coordinator]
        for link in links:
            if link is not None:
                _send(link, "bye")

    def settle(self) -> None:
        """The main thread's work raised: when that came from a dead process, the watch
        ends this process within ``SETTLE_S`` with its line; otherwise this returns."""
        if self.lost.wait(SETTLE_S):
            time.sleep(3600)  # the watch thread is ending the process

    # -- the watch thread --------------------------------------------------------------

    def _report(self, what: str, lost: int | None,
                tell: list[socket.socket] = ()) -> None:
        """Prints this process's one line and ends it; process 0 first tells the others."""
        with self._lock:
            if self._leaving or self.lost.is_set():
                return
            self.lost.set()
        for link in tell:
            _send(link, f"lost {lost}")
        try:
            self.before_exit()
            self._say(f"train.py: {what}; this process ({self.index}) stops: exit "
                      f"{self.exit_code}; the checkpoints saved before are intact: re-run the "
                      "same command in every process to resume")
        finally:
            if tell:  # the others leave before process 0 takes the coordinator away
                deadline = time.monotonic() + DRAIN_S
                while time.monotonic() < deadline and any(_open(p) for p in tell):
                    time.sleep(0.02)
            os._exit(self.exit_code)

    def _who(self, k: int | None) -> str:
        return f"process {k} of {self.count}" if k is not None else "a process"

    def _serve(self, server: socket.socket) -> None:
        """Process 0: accepts the others' links and watches them."""
        sel = selectors.DefaultSelector()
        sel.register(server, selectors.EVENT_READ)
        buffers: dict[socket.socket, bytes] = {}
        said_bye: set[socket.socket] = set()
        while True:
            for key, _ in sel.select():
                if key.fileobj is server:
                    link, _ = server.accept()
                    _keepalive(link)
                    with self._lock:
                        self._peers[link] = None
                        leaving = self._leaving
                    if leaving:
                        _send(link, "bye")
                    buffers[link] = b""
                    sel.register(link, selectors.EVENT_READ)
                    continue
                link = key.fileobj
                data, error = _recv(link)
                if data:
                    buffers[link] += data
                    *lines, buffers[link] = buffers[link].split(b"\n")
                    for message in lines:
                        word, _, arg = message.decode().partition(" ")
                        if word == "hello":
                            self._peers[link] = int(arg)
                        elif word == "bye":
                            said_bye.add(link)
                    continue
                sel.unregister(link)
                k = self._peers.pop(link, None)
                if link in said_bye:
                    continue
                others = [p for p in self._peers if p not in said_bye]
                self._report(f"{self._who(k)} {_how(error)}", k, others)

    def _follow(self, link: socket.socket) -> None:
        """The others: reads process 0's messages until it says bye or goes."""
        buffer = b""
        while True:
            data, error = _recv(link)
            if not data:
                self._report(f"the coordinator (process 0 of {self.count}) {_how(error)}", 0)
                return
            buffer += data
            *lines, buffer = buffer.split(b"\n")
            for message in lines:
                word, _, arg = message.decode().partition(" ")
                if word == "bye":
                    return  # process 0 ends deliberately; JAX's shutdown barrier does the rest
                if word == "lost":
                    k = int(arg) if arg.isdigit() else None
                    self._report(f"{self._who(k)} died or went silent (reported by process 0)", k)
                    return


def start(client, index: int, count: int, coordinator_host: str, exit_code: int,
          before_exit: Callable[[], None] = lambda: None) -> PeerWatch | None:
    """Opens the watch (``client``: JAX's distributed runtime client, for the key-value
    store); None, after one line saying so, when process 0 cannot be reached."""
    watch = PeerWatch(index, count, exit_code, before_exit)
    if index == 0:
        family = socket.AF_INET6 if socket.has_dualstack_ipv6() else socket.AF_INET
        server = socket.create_server(("", 0), family=family,
                                      dualstack_ipv6=family == socket.AF_INET6)
        client.key_value_set(KEY, f"{coordinator_host}|{server.getsockname()[1]}")
        target, arg = watch._serve, server
    else:
        try:
            host, port = client.blocking_key_value_get(KEY, int(CONNECT_TIMEOUT_S * 1000)).split("|")
            link = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
        except Exception as e:  # a firewall between hosts: JAX's heartbeat stays the only watch
            print(f"train.py: note: process {index} cannot reach process 0's watch ({e}); a dead "
                  "process will be found only by JAX's heartbeat", file=sys.stderr, flush=True)
            return None
        link.settimeout(None)
        _keepalive(link)
        _send(link, f"hello {index}")
        watch._coordinator = link
        target, arg = watch._follow, link
    threading.Thread(target=target, args=(arg,), name="lp_jax-peer-watch", daemon=True).start()
    return watch


def coordinator_host(address: str) -> str:
    """The host part of JAX's ``host:port`` coordinator address (``[v6]:port`` too)."""
    host = address.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _how(failed: bool) -> str:
    if failed:
        return f"went silent (its host answered no TCP keepalive probe for {SILENT_HOST_S} s)"
    return "died (its connection to the run closed without a goodbye)"


def _keepalive(link: socket.socket) -> None:
    link.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 4)):
        if hasattr(socket, name):  # Linux; elsewhere the system's (long) defaults apply
            link.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _send(link: socket.socket, message: str) -> None:
    try:
        link.sendall(message.encode() + b"\n")
    except OSError:
        pass  # the other end is gone; its end-of-file tells the rest


def _recv(link: socket.socket) -> tuple[bytes, bool]:
    """(data, whether the connection failed rather than closed)."""
    try:
        return link.recv(4096), False
    except OSError:
        return b"", True


def _open(link: socket.socket) -> bool:
    """Whether the other end has not closed ``link`` yet (does not consume data it sent)."""
    try:
        link.setblocking(False)
        return link.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False
