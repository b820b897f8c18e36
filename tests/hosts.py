"""Two processes on this machine as two hosts of one run (jax.distributed over loopback)."""
import socket
import subprocess
import time


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_two_hosts(command: list[str], env: dict, timeout: float = 240,
                  check: bool = True) -> list[tuple]:
  """Runs `command` as processes 0 and 1 of two (train.py's coordinator flags appended);
  their (stdout, stderr, exit code, seconds from the start to its end), once both have
  ended (with exit 0, if `check`). A hang fails after `timeout` seconds; both processes
  are always reaped."""
  port = free_port()
  start = time.monotonic()
  procs = [subprocess.Popen(
      [*command, "--coordinator_address", f"127.0.0.1:{port}", "--num_processes", "2",
       "--process_id", str(i)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True) for i in range(2)]
  ended = [None, None]
  try:
    # Both pipes read as they fill (a process blocked on a full pipe would seem to hang);
    # each end timed as it comes.
    import threading
    outs = [None, None]

    def read(i):
      outs[i] = procs[i].communicate()
      ended[i] = time.monotonic() - start
    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(2)]
    for r in readers:
      r.start()
    for r in readers:
      r.join(max(0.0, timeout - (time.monotonic() - start)))
    assert all(e is not None for e in ended), f"the hosts did not end within {timeout} s"
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  if check:
    for p, (_, err) in zip(procs, outs):
      assert p.returncode == 0, err[-3000:]
  return [(out, err, p.returncode, t) for (out, err), p, t in zip(outs, procs, ended)]
