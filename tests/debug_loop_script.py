"""One rank pauses at the same breakpoint N times in a row (``debug_loop_script.py N``); driven by
tests/test_debugger.py."""

import sys

from monarch_tensor.actor import Actor, endpoint, this_host


class Looper(Actor):
    @endpoint
    def loop(self, n: int) -> int:
        total = 0
        for i in range(n):
            breakpoint()
            total += i
        return total


if __name__ == "__main__":
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    n = int(sys.argv[1])
    print(f"RESULT {procs.spawn('looper', Looper).loop.call_one(n).get(timeout=300)}", flush=True)
    procs.stop()
    print("DONE", flush=True)
