"""Where watchdog heartbeats live (an in-process dict, a shared directory, the launch's TCP store) and what
/proc says about a process on this host."""
from __future__ import annotations

import fcntl
import os
import threading


# ---- stores -------------------------------------------------------------------------------------------
class MemoryStore:
    """A store for watchdogs living in one process (tests, single-process runs)."""

    def __init__(self):
        self._data: dict = {}
        self._lock = threading.Lock()

    def set(self, key: str, value: bytes) -> None:
        with self._lock:
            self._data[key] = bytes(value)

    def get(self, key: str) -> bytes:
        with self._lock:
            return self._data[key]

    def add(self, key: str, amount: int) -> int:
        with self._lock:
            value = int(self._data.get(key, b"0")) + amount
            self._data[key] = str(value).encode()
            return value

    def describe(self) -> str:
        return "an in-process store"


class FileStore:
    """Keys as files in a directory every rank sees (``AP_WATCHDOG_STORE=file:<dir>``)."""

    def __init__(self, directory: str):
        self.dir = os.path.abspath(directory)
        os.makedirs(self.dir, exist_ok=True)

    def _path(self, key: str) -> str:
        return os.path.join(self.dir, key.replace("/", "__"))

    def set(self, key: str, value: bytes) -> None:
        path = self._path(key)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "wb") as f:
            f.write(value)
        os.replace(tmp, path)

    def get(self, key: str) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise KeyError(key) from None

    def add(self, key: str, amount: int) -> int:
        if amount == 0:                     # a read: never wait on a lock a frozen rank may hold
            try:
                return int(self.get(key) or b"0")
            except KeyError:
                return 0
        with open(self._path(key) + ".lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                value = int(self.get(key) or b"0") + amount
            except KeyError:
                value = amount
            self.set(key, str(value).encode())
            return value

    def describe(self) -> str:
        return f"the heartbeat directory {self.dir}"


class TCPStoreClient:
    """A private client of the launch's TCP store (served by rank 0); never ``get`` a key that may be
    missing: paddle's ``get`` then blocks for good."""

    def __init__(self, host: str, port: int, world_size: int, host_rank: int = 0, timeout: int = 30):
        from autoparallel.compat import TCPStore

        self.host, self.port, self.host_rank = host, int(port), host_rank
        self._store = TCPStore(host, self.port, False, world_size, timeout)
        self._lock = threading.Lock()         # one request at a time: the client is not thread-safe

    @classmethod
    def from_env(cls, world_size: int) -> "TCPStoreClient":
        """The endpoint ``paddle.distributed.init_parallel_env`` uses for its store."""
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        endpoint = f"{addr}:{port}" if addr and port else os.environ.get("PADDLE_MASTER")
        if not endpoint:
            endpoint = (os.environ.get("PADDLE_TRAINER_ENDPOINTS") or "").split(",")[0]
        if ":" not in endpoint:
            raise RuntimeError("no TCP store endpoint in the environment (MASTER_ADDR/MASTER_PORT, PADDLE_MASTER "
                               "or PADDLE_TRAINER_ENDPOINTS); run under paddle.distributed.launch or set "
                               "AP_WATCHDOG_STORE=file:<dir shared by all ranks>")
        host, port = endpoint.rsplit(":", 1)
        return cls(host, int(port), world_size)

    def set(self, key: str, value: bytes) -> None:
        with self._lock:
            self._store.set(key, value)

    def get(self, key: str) -> bytes:
        with self._lock:
            return bytes(self._store.get(key))

    def add(self, key: str, amount: int) -> int:
        with self._lock:
            return int(self._store.add(key, amount))

    def describe(self) -> str:
        return f"the TCP store at {self.host}:{self.port} hosted by rank {self.host_rank}"


def default_store(world_size: int):
    spec = os.environ.get("AP_WATCHDOG_STORE", "")
    if spec.startswith("file:"):
        return FileStore(spec[len("file:"):])
    if spec not in ("", "tcp"):
        raise ValueError(f"AP_WATCHDOG_STORE must be 'tcp' or 'file:<dir>', got {spec!r}")
    if world_size <= 1:
        return MemoryStore()
    return TCPStoreClient.from_env(world_size)


# ---- processes on this host -------------------------------------------------------------------------
def _proc_start_time(pid: int):
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rindex(")") + 2:].split()[19]


def process_state(pid: int, start_time=None) -> str:
    """"running", "stopped" (SIGSTOP), "exited" or "unknown" for a process on this host."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except FileNotFoundError:
        return "exited"
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "exited"
        except OSError:
            return "unknown"
        return "running"
    fields = data[data.rindex(")") + 2:].split()
    if start_time is not None and fields[19] != start_time:
        return "exited"                      # the pid now belongs to another process
    if fields[0] in ("Z", "X", "x"):
        return "exited"
    if fields[0] in ("T", "t"):
        return "stopped"
    return "running"
