"""Two processes on this machine as two hosts of one run (jax.distributed over loopback)."""
import socket
import subprocess


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_two_hosts(command: list[str], env: dict, timeout: float = 240) -> list[tuple]:
  """Runs `command` as processes 0 and 1 of two (train.py's coordinator flags appended);
  their (stdout, stderr) once both have ended with exit 0. A hang fails after `timeout`
  seconds; both processes are always reaped."""
  port = free_port()
  procs = [subprocess.Popen(
      [*command, "--coordinator_address", f"127.0.0.1:{port}", "--num_processes", "2",
       "--process_id", str(i)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True) for i in range(2)]
  try:
    outs = [p.communicate(timeout=timeout) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  return outs
