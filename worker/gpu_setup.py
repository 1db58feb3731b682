"""TensorFlow device setup for a process the launcher placed: memory growth and a hard memory limit.

The launcher's plan gives each process (master or worker group) a TF memory limit so several processes
share a GPU without one taking it all (TF's default is to grab nearly every byte). This module must not
import ``launcher``: it runs inside the worker image.
"""

from __future__ import annotations

import logging
import os
from typing import Any, MutableMapping

logger = logging.getLogger(__name__)

# Docker Swarm names the generic resources it assigned to a task in DOCKER_RESOURCE_<KIND> (the kind upper-cased,
# nothing else changed): the launcher's services reserve kind NVIDIA-GPU. The others are kinds seen in guides.
SWARM_GPU_ENV = ("DOCKER_RESOURCE_NVIDIA-GPU", "DOCKER_RESOURCE_NVIDIA_GPU", "DOCKER_RESOURCE_GPU")


def adopt_swarm_gpus(environ: MutableMapping[str, str] | None = None) -> tuple[str, ...]:
    """Make CUDA see exactly the GPUs Docker Swarm assigned to this task, and return them.

    On a swarm the engine, not the launcher, picks a task's GPUs and names them in ``DOCKER_RESOURCE_NVIDIA-GPU``
    (the NVIDIA runtime mounts them when its ``swarm-resource`` setting names that variable). This copies them
    into ``NVIDIA_VISIBLE_DEVICES`` and, when they are UUIDs, ``CUDA_VISIBLE_DEVICES`` (a UUID names the same GPU
    inside and outside the container; an index may not), so a node whose runtime mounts more GPUs than assigned
    still uses only the assigned ones. Must run before TensorFlow loads. No such variable: nothing changes.
    """
    env = os.environ if environ is None else environ
    for name in SWARM_GPU_ENV:
        ids = tuple(x.strip() for x in env.get(name, "").split(",") if x.strip())
        if ids:
            env["NVIDIA_VISIBLE_DEVICES"] = ",".join(ids)
            if all(i.startswith(("GPU-", "MIG-")) for i in ids):
                env["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
                env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
            logger.info("swarm assigned GPU(s) %s (%s)", ", ".join(ids), name)
            return ids
    return ()


def configure_tf_devices(memory_limit_bytes: int | None, *, tf: Any = None) -> list[str]:
    """Turn on memory growth for every visible GPU and, given a limit, cap TF's allocator at it.

    Must run before TensorFlow touches a GPU (before the first op or model); afterwards TF refuses device
    changes and this raises. With no visible GPU (CPU machines, ``CUDA_VISIBLE_DEVICES=""``) it does nothing.

    Args:
        memory_limit_bytes: the most GPU memory TF may allocate in this process, in bytes (rounded down to
            whole MiB, TF's unit); None: memory growth only.
        tf: the ``tensorflow`` module (tests pass it; None imports it).

    Returns:
        The names of the GPUs configured (empty on a CPU machine).

    Raises:
        ValueError: a limit below 1 MiB.
        RuntimeError: TensorFlow already initialised its GPUs in this process.
    """
    if memory_limit_bytes is not None and memory_limit_bytes < 2**20:
        raise ValueError(f"memory_limit_bytes must be at least 1 MiB, got {memory_limit_bytes}")
    if tf is None:
        import tensorflow  # heavy: only processes that train or act pay for it

        tf = tensorflow
    gpus = tf.config.list_physical_devices("GPU")
    for gpu in gpus:
        # Growth first: TF refuses to change it once a logical (virtual) device is configured, while the
        # two together are allowed and give an allocator that grows on demand up to the limit.
        tf.config.experimental.set_memory_growth(gpu, True)
        if memory_limit_bytes is not None:
            limit_mib = int(memory_limit_bytes // 2**20)
            tf.config.set_logical_device_configuration(gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=limit_mib)])
    if gpus:
        logger.info(
            "TF GPUs %s: memory growth on, limit %s",
            ", ".join(g.name for g in gpus),
            "none" if memory_limit_bytes is None else f"{memory_limit_bytes // 2**20} MiB",
        )
    return [g.name for g in gpus]
