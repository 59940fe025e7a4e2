"""Buddy copies: each rank's memory snapshots also held by a rank on another host.

A rank's own snapshots (:mod:`.snapshots`) die with its host. A buddy on another host (in
another failure domain, where the topology names them) keeps the last ``keep`` copies
of each snapshot it is sent, so a pure FSDP2 job, which has no replica of a shard, can get a
lost rank's shard back from memory. Why it is built the way it is:

* Transport: a TCP connection per copy, from the sender's thread to a listener thread in
  the buddy's process, advertised over the process group. Not a gloo group: its
  collectives need every member, a dead peer fails the whole group (the re-form then has
  to rebuild it) and a replacement could not pull its shard before joining; a socket fails
  only the one copy, and a replacement asks the buddy for it by address.
* Off the training thread: the snapshot's check thread hands the checked snapshot over,
  the sender thread sends the newest one handed (an older one still waiting is dropped).
  The snapshot's buffers stay untouched while they are sent (:attr:`.Snapshot.busy`).
* Never trusted blindly: the header carries the owner's checksum and step and an
  HMAC-SHA256 under a key agreed over the process group (the values are pickled; only a
  header from the job's own ranks is unpickled). The receiver recomputes the checksum at
  once (a copy damaged in transit is dropped) and again before a copy is used
  (:meth:`BuddyCopy.check`).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import pickle
import socket
import struct
import threading
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from trainguard.contract.buddy import BuddyHeader

from .snapshots import Snapshot, tensor_bytes

log = logging.getLogger("trainguard.buddy")

Address = tuple[str, int]
_LEN = struct.Struct(">I")
_MAC = 32
_CHUNK = 1 << 20


def buddy_targets(hosts: Sequence[str],
                  domains: Sequence[str | None] | None = None) -> list[int | None]:
    """For each rank, the rank it sends its snapshots to: never on its own host, and in
    another failure domain where ``domains`` names every rank's and that is possible.
    Ranks are ordered by (domain, host, rank) and each sends to the one ``shift`` places
    on, ``shift`` the largest block: a permutation (each rank holds one buddy's copies)
    whenever no host holds more than half the ranks; past that, some hold two. None: every
    rank is on one host."""
    def plan(block: Sequence[str]) -> list[int | None] | None:
        n = len(block)
        sizes: dict[str, int] = {}
        for b in block:
            sizes[b] = sizes.get(b, 0) + 1
        if len(sizes) < 2:
            return None
        order = sorted(range(n), key=lambda r: (block[r], hosts[r], r))
        shift = max(sizes.values())
        targets: list[int | None] = [None] * n
        for p, r in enumerate(order):
            q = next(order[(p + shift + i) % n] for i in range(n)
                     if block[order[(p + shift + i) % n]] != block[r])
            targets[r] = q
        return targets

    if domains is not None and all(domains):
        by_domain = plan([str(d) for d in domains])
        if by_domain is not None:
            return by_domain
    return plan(list(hosts)) or [None] * len(hosts)


@dataclass
class BuddyCopy:
    """A copy of another rank's snapshot, held here."""

    rank: int
    step: int
    crc: int
    names: list[str]
    shapes: list[list[int]]
    dtypes: list[str]
    values: dict[str, Any]
    data: bytearray
    received: float

    def check(self) -> str:
        """Why this copy must not be used ("" when it may): its checksum recomputed."""
        if zlib.crc32(self.data) != self.crc:
            return (f"rank {self.rank}'s copy of step {self.step} held by its buddy failed "
                    "its checksum")
        return ""

    def snapshot(self, origin: str = "") -> Snapshot:
        """This copy as a snapshot of its owner's state (its check the owner's checksum):
        :meth:`.MemorySnapshots.adopt` and ``restore`` verify and restore it like an own
        one. ``origin`` names where it came from in a refusal."""
        snap = Snapshot(step=self.step, names=list(self.names), tensors=self.tensors(),
                        values=self.values, taken=self.received, nbytes=len(self.data),
                        origin=origin)
        snap.check.set_result((self.crc, ""))
        return snap

    def tensors(self) -> list[torch.Tensor]:
        """The tensors, as views of :attr:`data` (no copy)."""
        out, at = [], 0
        for shape, dtype in zip(self.shapes, self.dtypes, strict=True):
            dt = getattr(torch, dtype.removeprefix("torch."))
            numel = 1
            for d in shape:
                numel *= d
            size = numel * torch.empty((), dtype=dt).element_size()
            t = torch.frombuffer(self.data, dtype=torch.uint8, offset=at, count=size) \
                if size else torch.empty(0, dtype=torch.uint8)
            out.append(t.view(dt).reshape(shape))
            at += size
        return out


class Buddies:
    """This rank's buddy listener (the copies it holds for others) and sender (its own
    snapshots to its buddy).

    Args:
        rank: this rank's rank in the job.
        bind: the address the listener binds and advertises.
        keep: copies kept per rank whose copies this one holds.
        timeout: seconds a connection may wait for its peer.
    """

    def __init__(self, rank: int, *, bind: str = "127.0.0.1", keep: int = 2,
                 timeout: float = 30.0) -> None:
        self.rank = rank
        self.keep = keep
        self.timeout = timeout
        self._key: bytes | None = None
        self.target: Address | None = None
        """Where this rank's snapshots go (None: no buddy on another host)."""
        self.target_rank: int | None = None
        self.peers: dict[int, Address] = {}
        """Every rank's listener, by rank."""
        self.held_for: list[int] = []
        """The ranks whose copies this one holds, as the pairing says."""
        self.sent: list[int] = []
        """Steps sent and acknowledged, newest last (the last few)."""
        self.failures = 0
        self._corrupting = False
        self._copies: dict[int, list[BuddyCopy]] = {}
        self._lock = threading.Condition()
        """Guards the copies and :attr:`sent`; notified at each change."""
        self._pending: Snapshot | None = None
        self._wake = threading.Condition()
        self._closed = False
        self._server = socket.create_server((bind, 0))
        self._server.settimeout(0.5)
        self.address: Address = (bind, self._server.getsockname()[1])
        self._threads = [threading.Thread(target=self._serve, name="trainguard-buddy-in",
                                          daemon=True),
                         threading.Thread(target=self._send_loop, name="trainguard-buddy-out",
                                          daemon=True)]
        for t in self._threads:
            t.start()

    @staticmethod
    def new_key() -> bytes:
        import secrets
        return secrets.token_bytes(32)

    def pair(self, key: bytes, ranks: Sequence[int], addresses: Sequence[Address],
             hosts: Sequence[str], domains: Sequence[str | None] | None = None) -> None:
        """Every member's rank, listener address and host (in group order) and the job's
        buddy key (the same on every rank; :meth:`new_key` on one): choose the buddy."""
        self._key = key
        self.peers = {r: (a[0], a[1]) for r, a in zip(ranks, addresses, strict=True)}
        targets = buddy_targets(hosts, domains)
        me = targets[list(ranks).index(self.rank)]
        self.target_rank = ranks[me] if me is not None else None
        self.target = (addresses[me][0], addresses[me][1]) if me is not None else None
        self.held_for = [ranks[i] for i, t in enumerate(targets)
                         if t is not None and ranks[t] == self.rank]
        if me is None:
            log.warning("no rank on another host: memory snapshots stay on this host only")
        else:
            log.info("memory snapshots of rank %d go to rank %d on %s", self.rank,
                     self.target_rank, hosts[me])

    # -- sending --------------------------------------------------------------------------
    def send(self, snap: Snapshot) -> None:
        """Hand a checked snapshot to the sender thread (returns at once)."""
        if self.target is None:
            return
        with self._wake:
            self._pending = snap
            self._wake.notify()

    def _send_loop(self) -> None:
        while True:
            with self._wake:
                while self._pending is None and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                snap, self._pending = self._pending, None
            assert snap is not None
            try:
                self._send(snap)
            except OSError as exc:
                self.failures += 1
                log.warning("the copy of step %d did not reach the buddy at %s: %s",
                            snap.step, self.target, exc)

    def _send(self, snap: Snapshot) -> None:
        target = self.target
        if target is None:
            return
        with snap.busy:
            if not snap.kept:
                return  # replaced meanwhile: a newer one follows
            crc, poisoned = snap.verdict()
            if poisoned:
                return
            header = _put(self.rank, snap.step, crc, snap.names,
                          [list(t.shape) for t in snap.tensors],
                          [str(t.dtype) for t in snap.tensors], snap.values, snap.nbytes)
            with socket.create_connection(target, timeout=self.timeout) as conn:
                self._write(conn, header)
                for t in snap.tensors:
                    if t.numel():
                        conn.sendall(memoryview(tensor_bytes(t)))
                ack = self._read(conn)
        if ack.kind == "put" and ack.step == snap.step:
            with self._lock:
                self.sent = [*self.sent[-3:], snap.step]
                self._lock.notify_all()

    # -- receiving ------------------------------------------------------------------------
    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), name="trainguard-buddy-conn",
                             daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(self.timeout)
            try:
                header = self._read(conn)
                if header.kind == "put":
                    self._receive(conn, header)
                elif header.kind == "get":
                    self._answer(conn, header)
            except (OSError, ValueError, msgspec.DecodeError) as exc:
                log.warning("a buddy connection failed: %s", exc)

    def _receive(self, conn: socket.socket, header: BuddyHeader) -> None:
        copy = _read_copy(conn, header)
        why = copy.check()
        if why:
            log.warning("dropped: %s (damaged in transit)", why)
            self._write(conn, BuddyHeader(kind="none", rank=header.rank, step=header.step))
            return
        if self._corrupting:
            _flip(copy)
        with self._lock:
            ring = [c for c in self._copies.get(header.rank, []) if c.step != copy.step]
            self._copies[header.rank] = [*ring, copy][-self.keep:]
            self._lock.notify_all()
        self._write(conn, BuddyHeader(kind="put", rank=header.rank, step=header.step))

    def _answer(self, conn: socket.socket, header: BuddyHeader) -> None:
        copy = self.copy(header.rank, header.step if header.step >= 0 else None)
        if copy is None:
            self._write(conn, BuddyHeader(kind="none", rank=header.rank, step=header.step))
            return
        self._write(conn, _put(copy.rank, copy.step, copy.crc, copy.names, copy.shapes,
                               copy.dtypes, copy.values, len(copy.data)))
        conn.sendall(memoryview(copy.data))

    def fetch(self, address: Address, rank: int, step: int | None = None) -> BuddyCopy | None:
        """Ask the listener at ``address`` for its copy of ``rank``'s state at ``step``
        (None: the newest it holds); None when it holds none. Checked on arrival."""
        with socket.create_connection(address, timeout=self.timeout) as conn:
            self._write(conn, BuddyHeader(kind="get", rank=rank,
                                          step=step if step is not None else -1))
            header = self._read(conn)
            return _read_copy(conn, header) if header.kind == "put" else None

    # -- framing --------------------------------------------------------------------------
    def _write(self, conn: socket.socket, header: BuddyHeader) -> None:
        body = msgspec.msgpack.encode(header)
        conn.sendall(_LEN.pack(len(body)) + body + hmac.digest(self._keyed(), body,
                                                                hashlib.sha256))

    def _keyed(self) -> bytes:
        if self._key is None:
            raise ValueError("no buddy key yet (not paired)")
        return self._key

    def _read(self, conn: socket.socket) -> BuddyHeader:
        size = _LEN.unpack(_exactly(conn, _LEN.size))[0]
        if size > 1 << 28:
            raise ValueError(f"a buddy header of {size} bytes")
        body = _exactly(conn, size)
        mac = _exactly(conn, _MAC)
        if not hmac.compare_digest(mac, hmac.digest(self._keyed(), body, hashlib.sha256)):
            raise ValueError("a buddy header without the job's key")
        return msgspec.msgpack.decode(body, type=BuddyHeader)

    # -- what is held ---------------------------------------------------------------------
    def copy(self, rank: int, step: int | None = None) -> BuddyCopy | None:
        """The copy of ``rank``'s state at ``step`` (None: the newest) held here."""
        with self._lock:
            ring = list(self._copies.get(rank, []))
        if step is None:
            return ring[-1] if ring else None
        return next((c for c in ring if c.step == step), None)

    def wait_held(self, rank: int, step: int, timeout: float) -> BuddyCopy | None:
        """The copy of ``rank``'s state at ``step`` once it is held here (None: not
        within ``timeout`` seconds)."""
        with self._lock:
            self._lock.wait_for(lambda: self.copy(rank, step) is not None, timeout)
        return self.copy(rank, step)

    def wait_sent(self, step: int, timeout: float) -> bool:
        """Whether the buddy acknowledged the copy of ``step`` within ``timeout`` s."""
        with self._lock:
            return self._lock.wait_for(lambda: step in self.sent, timeout)

    def held(self) -> dict[int, list[int]]:
        """rank -> the steps of the copies of its state held here, oldest first."""
        with self._lock:
            return {r: [c.step for c in ring] for r, ring in self._copies.items() if ring}

    @property
    def nbytes(self) -> int:
        """Host memory the copies held here take."""
        with self._lock:
            return sum(len(c.data) for ring in self._copies.values() for c in ring)

    def corrupt(self) -> str:
        """The drill ``corrupt_copies``: a byte flips in every copy held here and in every
        one received from now on (this host's memory went bad)."""
        self._corrupting = True
        with self._lock:
            copies = [c for ring in self._copies.values() for c in ring]
        for c in copies:
            _flip(c)
        return (f"a byte flipped in {len(copies)} copies held here, and in every copy "
                "received from now on")

    def restored(self, step: int) -> None:
        """The job went back to ``step``: copies of later steps are of the abandoned
        timeline."""
        with self._lock:
            self._copies = {r: [c for c in ring if c.step <= step]
                            for r, ring in self._copies.items()}
        with self._lock:
            self.sent = [s for s in self.sent if s <= step]

    def forget(self, rank: int | None = None) -> None:
        """Drop the copies held for ``rank`` (None: all)."""
        with self._lock:
            if rank is None:
                self._copies.clear()
            else:
                self._copies.pop(rank, None)

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._server.close()
        for t in self._threads:
            t.join(timeout=self.timeout)


def _flip(copy: BuddyCopy) -> None:
    if copy.data:
        copy.data[len(copy.data) // 2] ^= 0xFF


def _exactly(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ValueError(f"the connection ended after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def _put(rank: int, step: int, crc: int, names: list[str], shapes: list[list[int]],
         dtypes: list[str], values: dict[str, Any], nbytes: int) -> BuddyHeader:
    return BuddyHeader(kind="put", rank=rank, step=step, crc=crc, names=list(names),
                       shapes=shapes, dtypes=dtypes, values=pickle.dumps(values),
                       nbytes=nbytes)


def _read_copy(conn: socket.socket, header: BuddyHeader) -> BuddyCopy:
    """The tensor bytes that follow a ``put`` header."""
    data = bytearray(header.nbytes)
    view, got = memoryview(data), 0
    while got < header.nbytes:
        n = conn.recv_into(view[got:], min(_CHUNK, header.nbytes - got))
        if not n:
            raise ValueError(f"rank {header.rank}'s copy of step {header.step} ended "
                             f"after {got} of {header.nbytes} bytes")
        got += n
    # ``header`` came through :meth:`Buddies._read`, which refuses one without the
    # job's HMAC: only the job's own ranks' pickles are loaded.
    return BuddyCopy(rank=header.rank, step=header.step, crc=header.crc,
                     names=header.names, shapes=header.shapes, dtypes=header.dtypes,
                     values=pickle.loads(header.values), data=data, received=time.time())
