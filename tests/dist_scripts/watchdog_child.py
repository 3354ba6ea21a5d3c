"""One watchdog rank in its own process, sharing a FileStore with the test process.
Usage: watchdog_child.py STORE_DIR RANK WORLD TIMEOUT MODE   (MODE: hold | save | raise | clean | sigterm)"""
import os
import signal
import sys
import time

from autoparallel.watchdog import FileStore, Watchdog

store_dir, rank, world, timeout, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), \
    sys.argv[5]
wd = Watchdog(timeout=timeout, store=FileStore(store_dir), rank=rank, world_size=world).start()
print("ready", flush=True)
with wd.op("all_reduce", step=3):
    if mode == "hold":
        time.sleep(600)
    elif mode == "save":
        with wd.long_wait("checkpoint write"):   # a long operation: peers may allow up to 2 x timeout
            time.sleep(600)
    elif mode == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)       # held by the watchdog for its grace, then the exit
        time.sleep(600)
    elif mode == "raise":
        time.sleep(4 * wd.interval)
        raise RuntimeError("boom: Connection reset by peer")
    else:
        time.sleep(4 * wd.interval)
wd.stop()
print("clean exit", flush=True)
