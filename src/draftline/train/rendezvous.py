"""The launchers' rendezvous in a multi-node finetune: node 0's draftline holds a torch ``TCPStore`` on the
port after the ranks' master port; every other node's draftline connects to it.

Node 0 waits for every node to join with its settings and refuses a job whose nodes disagree, before any
MLflow run exists; then it opens the one run, resolves everything once and hands every node the same rank
spec. While the ranks train, each launcher beats and watches: a node that fails, or stops beating, stops
every node. Keys: ``join/<k>``, ``go``, ``ready/<k>``, ``beat/<k>``, ``failed/<k>``, ``done/<k>``.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

from torch.distributed import DistError, TCPStore

from draftline import environment, errors
from draftline.errors import TrainingError, UsageError
from draftline.train.nodes import Place

BEAT_S = 2.0
# a node whose beat has not moved for this long is gone (its finetune killed, its machine lost)
SETTLE_S = 8.0  # after a failure: how long to wait for the node that caused it to say why


def _j(value) -> str:
    return json.dumps(value)


def _read(raw: bytes):
    return json.loads(raw.decode())


def differences(mine: dict, theirs: dict) -> list[str]:
    """The names of the settings two nodes disagree on, sorted."""
    keys = sorted(set(mine) | set(theirs))
    return [k for k in keys if mine.get(k) != theirs.get(k)]


def lost(node: int, after: str = "") -> str:
    return f"node {node} stopped answering{after} (its finetune was killed or its machine lost)"


class Beats:
    """When each node's beat counter last moved, as this process saw it (first read: now)."""

    def __init__(self, store: TCPStore):
        self.store = store
        self.heard: dict[int, tuple[int, float]] = {}

    def silent_for(self, node: int) -> float:
        """Seconds since ``node``'s beat last moved."""
        beat, now = self.store.add(f"beat/{node}", 0), time.monotonic()
        if self.heard.get(node, (None,))[0] != beat:
            self.heard[node] = (beat, now)
        return now - self.heard[node][1]


class Rendezvous:
    """One node's end of the store (node 0 serves it). Every method raises a one-line DraftlineError."""

    def __init__(self, place: Place, timeout_s: float):
        self.place, self.timeout_s = place, timeout_s
        self.others = [j for j in range(place.nnodes) if j != place.node_rank]
        self.store = self._connect(timeout_s)

    def _connect(self, timeout_s: float) -> TCPStore:
        p = self.place
        try:
            if p.leader:
                return TCPStore(p.master_addr, p.store_port, is_master=True, wait_for_workers=False,
                                timeout=timedelta(seconds=timeout_s))
            return TCPStore(p.master_addr, p.store_port, is_master=False, timeout=timedelta(seconds=timeout_s))
        except DistError as e:
            if p.leader:
                raise TrainingError(f"node 0 cannot listen on port {p.store_port} ({str(e).splitlines()[0]}): "
                                    "pass another --master-port (node 0 uses it and the next one)") from None
            raise TrainingError(f"node {p.node_rank}: node 0 did not answer at {p.master_addr}:{p.store_port} "
                                f"within {timeout_s:.0f} s: start the same finetune on node 0, or check "
                                "--master-addr/--master-port (node 0 listens on the port and the next one)") \
                from None

    # -- before the run: node 0 gathers, every node checks, node 0 says go ------------------------------------
    def gather(self, settings: dict) -> None:
        """Node 0: wait for every node's settings; refuse (and tell them) when any node differs."""
        keys = [f"join/{j}" for j in self.others]
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout_s))
        except DistError:
            missing = [str(j) for j in self.others if not self.store.check([f"join/{j}"])]
            self.abort(f"node {', '.join(missing)} of {self.place.nnodes} did not join within "
                       f"{self.timeout_s:.0f} s: start the same finetune on every node (or raise "
                       "--rendezvous-timeout)")
        for j in self.others:
            theirs = _read(self.store.get(f"join/{j}"))
            diff = differences(settings, theirs)
            if diff:
                said = ", ".join(f"{k} ({settings.get(k)!r} on node 0, {theirs.get(k)!r} on node {j})"
                                 for k in diff[:4])
                self.abort(f"node {j}'s settings differ from node 0's: {said}: run the same finetune, with the "
                           "same data and settings, on every node")

    def tell(self, message: str, cls: type[Exception] = UsageError) -> None:
        """Node 0: tell every node why the job does not start (or, once started, why it ends)."""
        with contextlib.suppress(DistError):
            self.store.set("go", _j({"abort": message, "type": cls.__name__}))
            self.store.set(f"failed/{self.place.node_rank}", _j({"message": message, "draftline": True}))

    def abort(self, message: str, cls: type[Exception] = UsageError) -> None:
        """:meth:`tell`, and raise it here."""
        self.tell(message, cls)
        raise cls(message)

    def go(self, payload: dict) -> None:
        self.store.set("go", _j(payload))

    def join(self, settings: dict) -> dict:
        """Node k: send this node's settings; wait (as long as node 0 answers) for its go, or its refusal."""
        self.store.set(f"join/{self.place.node_rank}", _j(settings))
        while True:
            try:
                if self.store.check(["go"]):
                    answer = _read(self.store.get("go"))
                    self.store.set(f"ack/{self.place.node_rank}", "1")  # node 0 may end once all have read it
                    break
            except DistError:
                raise TrainingError(f"node {self.place.node_rank}: node 0 went away before the job started "
                                    "(its own message says why)") from None
            time.sleep(0.5)
        if "abort" in answer:
            cls = getattr(errors, answer.get("type", ""), None)
            if not (isinstance(cls, type) and issubclass(cls, errors.DraftlineError)) or cls is errors.Interrupted:
                cls = TrainingError
            raise cls(answer["abort"])
        return answer

    def ready(self, error: str | None = None) -> None:
        self.store.set(f"ready/{self.place.node_rank}", _j({"error": error}))

    def wait_ready(self) -> None:
        """Node 0: every node saw the spec's files; the first that did not is raised (and told to the others)."""
        try:
            self.store.wait([f"ready/{j}" for j in self.others], timedelta(seconds=self.timeout_s))
        except DistError:
            self.abort(f"a node did not confirm the job's files within {self.timeout_s:.0f} s", TrainingError)
        for j in self.others:
            err = _read(self.store.get(f"ready/{j}"))["error"]
            if err:
                self.abort(f"node {j}: {err}", TrainingError)

    # -- while the ranks train -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def watch(self, terminate: Callable[[], None]) -> Iterator[Watch]:
        """Beat, and end this node's ranks (``terminate``) when another node fails or stops beating."""
        w = Watch(self, terminate)
        w.start()
        try:
            yield w
        finally:
            w.stop()

    def fail(self, message: str, *, draftline: bool) -> None:
        """Tell the other nodes this node's ranks failed, and why."""
        with contextlib.suppress(DistError):
            self.store.set(f"failed/{self.place.node_rank}", _j({"message": message, "draftline": draftline}))

    def cause(self, own: str) -> str:
        """After this node's ranks failed: the node that caused it and why (waiting up to SETTLE_S for it to
        say), else ``own``. A user's mistake (a DraftlineError on some rank) wins over a peer's lost socket."""
        deadline, seen, beats, silent = time.monotonic() + SETTLE_S, {}, Beats(self.store), {}
        while time.monotonic() < deadline:
            try:
                for j in self.others:
                    if j not in seen and self.store.check([f"failed/{j}"]):
                        seen[j] = _read(self.store.get(f"failed/{j}"))
                    silent[j] = beats.silent_for(j)
            except DistError:
                return lost(0)
            user = next((j for j, f in seen.items() if f["draftline"]), None)
            if user is not None:
                return f"node {user}: {seen[user]['message']}"
            time.sleep(0.5)
        gone = [j for j, t in silent.items() if t >= SETTLE_S - 1]
        if gone:
            return lost(gone[0])
        if seen:
            j = min(seen)
            return f"node {j}: {seen[j]['message']}"
        return own

    def stopped(self, signal_name: str) -> None:
        """This node was signalled: its ranks and every other node's save and stop at the same step."""
        with contextlib.suppress(DistError):
            self.store.set(f"stopped/{self.place.node_rank}", signal_name)

    def stopped_by(self) -> tuple[int, str] | None:
        """``(node, signal)`` when another node was signalled (its ranks stopped every node's, cleanly)."""
        with contextlib.suppress(DistError):
            for j in self.others:
                if self.store.check([f"stopped/{j}"]):
                    return j, self.store.get(f"stopped/{j}").decode()
        return None

    def wait_read(self) -> None:
        """Node 0, ending before the ranks started: keep the store up until every node that joined has read why
        (or SETTLE_S passed)."""
        deadline = time.monotonic() + SETTLE_S
        with contextlib.suppress(DistError):
            while time.monotonic() < deadline:
                joined = [j for j in self.others if self.store.check([f"join/{j}"])]
                if all(self.store.check([f"ack/{j}"]) for j in joined):
                    return
                time.sleep(0.2)

    def done(self) -> None:
        with contextlib.suppress(DistError):
            self.store.set(f"done/{self.place.node_rank}", "1")

    def wait_done(self) -> None:
        """Node 0 keeps the store up until every node's ranks ended: each said so, or stopped beating."""
        beats = Beats(self.store)
        with contextlib.suppress(DistError):
            while True:
                waiting = [j for j in self.others
                           if not (self.store.check([f"done/{j}"]) or self.store.check([f"failed/{j}"]))]
                if all([beats.silent_for(j) > 3 * BEAT_S for j in waiting]):  # every node read on each pass
                    return
                time.sleep(0.5)

    def close(self) -> None:
        del self.store


class Watch(threading.Thread):
    """The launcher's watch: beats every BEAT_S; ``reason`` says why it ended this node's ranks (or None)."""

    def __init__(self, rdv: Rendezvous, terminate: Callable[[], None]):
        super().__init__(daemon=True, name="draftline-node-watch")
        self.rdv, self.terminate = rdv, terminate
        self.reason: str | None = None
        self._halt = threading.Event()
        p = rdv.place
        # its own connection: the main thread keeps using the other
        host = "127.0.0.1" if p.leader else p.master_addr
        self.store = TCPStore(host, p.store_port, is_master=False, timeout=timedelta(seconds=30))

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=10)

    def _end(self, reason: str) -> None:
        if not self._halt.is_set():
            self.reason = reason
            self.terminate()

    def run(self) -> None:
        me, others = self.rdv.place.node_rank, self.rdv.others
        beats = Beats(self.store)
        while not self._halt.wait(BEAT_S):
            try:
                self.store.add(f"beat/{me}", 1)
                for j in others:
                    if self.store.check([f"failed/{j}"]):
                        f = _read(self.store.get(f"failed/{j}"))
                        return self._end(f"node {j}: {f['message']}")
                    if not self.rdv.place.leader or self.store.check([f"done/{j}"]):
                        continue  # node 0's store going away is how a node sees node 0 lost
                    if beats.silent_for(j) > environment.NODE_STALE_S.get():
                        return self._end(lost(j, f" for {environment.NODE_STALE_S.get():.0f} s"))
            except DistError:
                return self._end(lost(0))
