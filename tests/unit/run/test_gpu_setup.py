"""worker.gpu_setup: a no-op with real TensorFlow on this GPU-less machine; the GPU path against a stand-in."""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from worker.gpu_setup import configure_tf_devices

REPO = Path(__file__).resolve().parents[3]


def test_no_gpu_is_a_no_op_with_real_tensorflow() -> None:
    code = (
        "from worker.gpu_setup import configure_tf_devices\n"
        "import tensorflow as tf\n"
        "print(configure_tf_devices(4 << 30), configure_tf_devices(None))\n"
        "print(tf.reduce_sum(tf.ones([3])).numpy())\n"  # TF still works afterwards
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": "", "TF_CPP_MIN_LOG_LEVEL": "3",
                              "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == ["[] []", "3.0"]


@dataclass
class FakeConfig:
    """Just enough of tf.config to record calls, with TF's rule that growth cannot follow a logical config."""

    gpus: list[Any]
    calls: list[tuple[str, str, Any]] = field(default_factory=list)

    def list_physical_devices(self, kind: str) -> list[Any]:
        return self.gpus if kind == "GPU" else []

    def set_memory_growth(self, dev: Any, enable: bool) -> None:
        if any(c[0] == "logical" and c[1] == dev.name for c in self.calls):
            raise ValueError("Cannot set memory growth on device when virtual devices configured")
        self.calls.append(("growth", dev.name, enable))

    def set_logical_device_configuration(self, dev: Any, configs: list[Any]) -> None:
        self.calls.append(("logical", dev.name, [c.memory_limit for c in configs]))


def fake_tf(n_gpus: int) -> tuple[Any, FakeConfig]:
    cfg = FakeConfig([SimpleNamespace(name=f"/physical_device:GPU:{i}") for i in range(n_gpus)])
    config = SimpleNamespace(
        list_physical_devices=cfg.list_physical_devices,
        set_logical_device_configuration=cfg.set_logical_device_configuration,
        LogicalDeviceConfiguration=lambda memory_limit: SimpleNamespace(memory_limit=memory_limit),
        experimental=SimpleNamespace(set_memory_growth=cfg.set_memory_growth),
    )
    return SimpleNamespace(config=config), cfg


def test_gpu_gets_growth_then_a_limit_in_mib() -> None:
    tf, cfg = fake_tf(1)
    assert configure_tf_devices(10 * 2**30 + 123, tf=tf) == ["/physical_device:GPU:0"]
    assert cfg.calls == [("growth", "/physical_device:GPU:0", True), ("logical", "/physical_device:GPU:0", [10240])]


def test_growth_only_without_a_limit() -> None:
    tf, cfg = fake_tf(2)
    configure_tf_devices(None, tf=tf)
    assert [c[0] for c in cfg.calls] == ["growth", "growth"]


def test_rejects_a_tiny_limit() -> None:
    with pytest.raises(ValueError, match="at least 1 MiB"):
        configure_tf_devices(1000, tf=fake_tf(1)[0])


def test_worker_module_does_not_import_launcher() -> None:
    tree = ast.parse((REPO / "worker" / "gpu_setup.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(name.split(".")[0] == "launcher" for name in imported)
