"""Four ranks paused at breakpoints on different lines; driven by tests/test_debugger.py."""

from monarch_tensor.actor import Actor, current_rank, endpoint, this_host


class Debugee(Actor):
    @endpoint
    def to_debug(self):
        rank = current_rank().rank
        value = rank * 10
        if rank % 2 == 0:
            breakpoint()  # even ranks stop here
            value += 1
        else:
            breakpoint()  # odd ranks stop here
            value += 2
        return value


if __name__ == "__main__":
    procs = this_host().spawn_procs(per_host={"gpus": 4})
    debugee = procs.spawn("debugee", Debugee)
    values = debugee.to_debug.call().get(timeout=300).values()
    # one write: the debugger prompt's thread prints "released ..." to this terminal at about this time
    print(f"RESULT {values}", flush=True)
    procs.stop()
    print("DONE", flush=True)
