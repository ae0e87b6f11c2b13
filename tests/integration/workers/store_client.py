"""Every TCPStore operation of this torch, as a client of the store at 127.0.0.1:PORT.

usage: store_client.py PORT ops      # set/get/add/compare_set/wait/num_keys/delete_key, prints OK
       store_client.py PORT wait     # waits 60 s for a key nobody sets (the store goes away)
"""
import sys
import time
from datetime import timedelta

import torch.distributed as dist


def check(got, want, what):
    if got != want:
        raise SystemExit(f"{what}: got {got!r}, want {want!r}")


def ops(store):
    store.set("k", "v1")
    check(store.get("k"), b"v1", "get")
    check(store.add("n", 5), 5, "add")
    check(store.add("n", -2), 3, "add again")
    check(store.get("n"), b"3", "add stores text")
    check(store.compare_set("k", "v1", "v2"), b"v2", "compare_set match")
    check(store.compare_set("k", "nope", "v3"), b"v2", "compare_set mismatch")
    check(store.compare_set("fresh", "", "f"), b"f", "compare_set creates")
    store.wait(["k", "n"])
    store.wait(["k"], timedelta(seconds=5))
    before = store.num_keys()
    check(store.delete_key("fresh"), True, "delete_key")
    check(store.delete_key("fresh"), False, "delete_key twice")
    check(store.num_keys(), before - 1, "num_keys after delete")
    store.set("big", b"x" * (4 << 20))
    check(len(store.get("big")), 4 << 20, "a 4 MiB value")
    prefixed = dist.PrefixStore("/worker/attempt_0", store)
    prefixed.set("p", "1")
    check(store.get("/worker/attempt_0/p"), b"1", "PrefixStore")
    start = time.monotonic()
    try:
        store.wait(["never"], timedelta(milliseconds=300))
        raise SystemExit("wait for a missing key did not time out")
    except RuntimeError as e:
        check("Timeout" in str(e) or "timeout" in str(e), True, f"timeout error text ({e})")
    check(time.monotonic() - start < 5, True, "the timeout is the client's")
    print("OK", flush=True)


def main():
    port, mode = int(sys.argv[1]), sys.argv[2]
    store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=30))
    if mode == "ops":
        ops(store)
    elif mode == "wait":
        print("waiting", flush=True)
        store.wait(["never"], timedelta(seconds=60))
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
