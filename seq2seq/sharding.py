"""Devices, mesh, partition specs and multi-host start-up.

The mesh has two axes: `data` (batch split, parameters replicated) and `fsdp` (batch split
too, and parameters sharded along their largest divisible dimension). With fsdp=1 this is
plain data parallelism, the modern form of pmap.
"""
from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from seq2seq.errors import UserError

BATCH_AXES = ("data", "fsdp")


def maybe_initialize_distributed(coordinator: str = "", num_processes: int = 0,
                                 process_id: int = -1) -> None:
  """Starts `jax.distributed` when launched as several processes.

  Flags win; otherwise the usual environment variables (JAX_COORDINATOR_ADDRESS,
  JAX_NUM_PROCESSES, JAX_PROCESS_ID) are read. On TPU pods and SLURM/Open MPI clusters
  `jax.distributed.initialize()` with no arguments finds everything itself: set
  SEQ2SEQ_DISTRIBUTED=auto for that.

  SEQ2SEQ_DIST_TIMEOUT (default 120 s) bounds the wait for every process to join, and
  SEQ2SEQ_HEARTBEAT_TIMEOUT (default 100 s, JAX's) how long the others run on after one
  process dies: then they stop too (exit 134), and rerunning all of them resumes from the
  last checkpoint.
  """
  coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS", "")
  num_processes = num_processes or int(os.environ.get("JAX_NUM_PROCESSES", "0") or 0)
  if process_id < 0:
    process_id = int(os.environ.get("JAX_PROCESS_ID", "-1") or -1)
  auto = os.environ.get("SEQ2SEQ_DISTRIBUTED") == "auto"
  if (num_processes > 1 or process_id >= 0) and not coordinator and not auto:
    raise UserError("multi-process run: give --coordinator_address HOST:PORT "
                    "(or JAX_COORDINATOR_ADDRESS)")
  if coordinator:
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
      raise UserError(f"coordinator address must be HOST:PORT, got {coordinator!r}")
    if num_processes < 1:
      raise UserError("multi-process run: give --num_processes (or JAX_NUM_PROCESSES)")
    if not 0 <= process_id < num_processes:
      raise UserError(f"--process_id must be in [0, {num_processes}) "
                      f"(or JAX_PROCESS_ID), got {process_id}")
  if coordinator and num_processes > 1:
    timeouts = dict(initialization_timeout=_env_seconds("SEQ2SEQ_DIST_TIMEOUT", 120),
                    heartbeat_timeout_seconds=_env_seconds("SEQ2SEQ_HEARTBEAT_TIMEOUT", 100))
    # CPU processes talk through gloo (only the CPU client reads this flag).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id, **timeouts)
  elif os.environ.get("SEQ2SEQ_DISTRIBUTED") == "auto":
    jax.distributed.initialize()


def _env_seconds(name: str, default: int) -> int:
  value = os.environ.get(name, "") or str(default)
  if not value.isdigit() or int(value) < 1:
    raise UserError(f"{name} must be a whole number of seconds >= 1, got {value!r}")
  return int(value)


def parse_mesh_shape(spec: str, num_devices: int) -> tuple[int, int]:
  """"" -> all devices on `data`; "data=4,fsdp=2" or "fsdp=8" (the rest goes to data)."""
  sizes = {"data": -1, "fsdp": 1}
  if spec:
    for part in spec.split(","):
      if "=" not in part or part.split("=")[0].strip() not in sizes:
        raise UserError(f"mesh_shape {spec!r}: expected e.g. 'data=4,fsdp=2'")
      k, v = part.split("=")
      try:
        sizes[k.strip()] = int(v)
      except ValueError:
        raise UserError(f"mesh_shape {spec!r}: {v!r} is not an integer") from None
    if "data" not in spec:
      sizes["data"] = -1
  if sizes["fsdp"] <= 0 or num_devices % sizes["fsdp"]:
    raise UserError(f"mesh_shape {spec!r}: fsdp={sizes['fsdp']} does not divide "
                    f"{num_devices} devices")
  if sizes["data"] == -1:
    sizes["data"] = num_devices // sizes["fsdp"]
  if sizes["data"] * sizes["fsdp"] != num_devices:
    raise UserError(f"mesh_shape {spec!r} needs {sizes['data'] * sizes['fsdp']} devices, "
                    f"there are {num_devices}")
  return sizes["data"], sizes["fsdp"]


def make_mesh(spec: str = "", devices=None) -> Mesh:
  devices = jax.devices() if devices is None else devices
  data, fsdp = parse_mesh_shape(spec, len(devices))
  return Mesh(np.asarray(devices).reshape(data, fsdp), BATCH_AXES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (batch) dimension split over every device."""
  return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def param_spec(shape: tuple[int, ...], fsdp_size: int, min_size: int = 2 ** 12) -> P:
  """FSDP: shard the largest dimension divisible by the fsdp size (small arrays replicated)."""
  if fsdp_size <= 1 or int(np.prod(shape)) < min_size:
    return P()
  for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
    if shape[dim] % fsdp_size == 0:
      spec = [None] * len(shape)
      spec[dim] = "fsdp"
      return P(*spec)
  return P()


def state_shardings(mesh: Mesh, abstract_state, fsdp: bool):
  """Shardings for a pytree of arrays: replicated, or FSDP-sharded when `fsdp`."""
  n = mesh.shape["fsdp"] if fsdp else 1
  return jax.tree_util.tree_map(
      lambda x: NamedSharding(mesh, param_spec(tuple(x.shape), n)), abstract_state)


def global_batch(local: dict, sharding: NamedSharding) -> dict:
  """This host's rows -> one global array per key, split along the batch axes."""
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
          for k, v in local.items()}


def to_host(x) -> np.ndarray:
  """A (possibly multi-host) global array as one NumPy array on every host."""
  if getattr(x, "is_fully_addressable", True):
    return np.asarray(x)
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))
