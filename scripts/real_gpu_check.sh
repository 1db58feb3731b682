#!/usr/bin/env bash
# The launcher's NVML side against a real GPU and driver (CI has none: it runs against the stand-in NVML).
# Needs python3.11+ with nvidia-ml-py and numpy, and PyTorch to make GPU processes; no TensorFlow, Docker or
# network. Run it from the repository root on a GPU host: `bash scripts/real_gpu_check.sh [OUTDIR]`.
# It starts three bounded PyTorch processes on GPU 0 (each exits by itself within 90 s):
#   - a lease holder's child (the holder takes GPU 0's lease in a private lock directory, then starts it):
#     part of the lease, so not foreign;
#   - an orphan started beside the holder: on a leased GPU and not part of the lease, so foreign;
#   - both allocate a known amount and keep the GPU busy, so the memory and utilisation NVML reports can be
#     compared with what they did.
# Then it records what `launcher gpus`, `launcher plan` and `launcher check` say, and the raw NVML figures.
set -uo pipefail
out=${1:-${OUT:-/tmp/real-gpu-check}}
mkdir -p "$out"
py=$(command -v python3.11 || command -v python3)
export PYTHONPATH=$PWD
locks=$(mktemp -d)
export LAUNCHER_LOCK_DIR=$locks
stop=$locks/stop
{
  date -u; hostname; id; uname -r
  "$py" --version
  "$py" -c "import pynvml, numpy; print('nvidia-ml-py', pynvml.__file__, 'numpy', numpy.__version__)"
  "$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  nvidia-smi
  nvidia-smi -q -d PERSISTENCE_MODE,MEMORY,UTILIZATION,COMPUTE | head -80
} > "$out/host.txt" 2>&1

# nvmlInit's time, and the raw figures the inventory is built from.
"$py" - > "$out/nvml_raw.txt" 2>&1 <<'EOF'
import time, pynvml as n
t = time.perf_counter(); n.nvmlInit(); print("nvmlInit_s", round(time.perf_counter() - t, 3))
print("driver", n.nvmlSystemGetDriverVersion(), "nvml", n.nvmlSystemGetNVMLVersion())
for i in range(n.nvmlDeviceGetCount()):
    h = n.nvmlDeviceGetHandleByIndex(i)
    print(i, n.nvmlDeviceGetName(h), n.nvmlDeviceGetUUID(h), n.nvmlDeviceGetPciInfo(h).busId)
    m = n.nvmlDeviceGetMemoryInfo(h); print(" memory v1 total/used/free", m.total, m.used, m.free)
    try:
        m2 = n.nvmlDeviceGetMemoryInfo(h, version=n.nvmlMemory_v2); print(" memory v2 total/used/reserved/free", m2.total, m2.used, m2.reserved, m2.free)
    except Exception as e: print(" memory v2:", repr(e))
    try: print(" mig mode", n.nvmlDeviceGetMigMode(h))
    except Exception as e: print(" mig mode:", repr(e))
    u = n.nvmlDeviceGetUtilizationRates(h); print(" utilisation gpu/mem", u.gpu, u.memory)
n.nvmlShutdown()
EOF

uuid0=$("$py" -c "import pynvml as n; n.nvmlInit(); print(n.nvmlDeviceGetUUID(n.nvmlDeviceGetHandleByIndex(0)))")
cat > "$locks/burn.py" <<'EOF'
import os, sys, time, torch
gib, stop, deadline = float(sys.argv[1]), sys.argv[2], time.monotonic() + 90
x = torch.empty(int(gib * (1 << 30)), dtype=torch.uint8, device="cuda")
a = torch.randn(4096, 4096, device="cuda")
open(stop + f".ready.{os.getpid()}", "w").close()
while not os.path.exists(stop) and time.monotonic() < deadline:
    for _ in range(20):
        a = (a @ a).clamp_(-1, 1)
    torch.cuda.synchronize()
EOF
# The lease holder: takes GPU 0's lease for run "realgpu-check", starts its child on the GPU, waits for the stop file.
"$py" - "$uuid0" "$locks" > "$out/holder.txt" 2>&1 <<'EOF' &
import subprocess, sys, time, os
from launcher.gpu.reservations import reserve
uuid, locks = sys.argv[1], sys.argv[2]
with reserve([uuid], "realgpu-check") as r:
    print("holder pid", os.getpid(), "holds", r.uuids, flush=True)
    child = subprocess.Popen([sys.executable, f"{locks}/burn.py", "2", f"{locks}/stop"])
    print("child pid", child.pid, flush=True)
    child.wait()
EOF
holder=$!
"$py" "$locks/burn.py" 1 "$stop" > "$out/orphan.txt" 2>&1 &
orphan=$!
echo "orphan pid $orphan" >> "$out/orphan.txt"
for _ in $(seq 120); do [ "$(ls "$locks" | grep -c 'stop.ready')" -ge 2 ] && break; sleep 0.5; done
sleep 3   # let NVML's utilisation window see the load
nvidia-smi --query-compute-apps=pid,used_memory,process_name --format=csv > "$out/smi_apps.csv" 2>&1
( time "$py" -m launcher gpus --no-docker --json ) > "$out/gpus.json" 2> "$out/gpus.time"
"$py" -m launcher gpus --no-docker > "$out/gpus.txt" 2>&1
"$py" -m launcher plan --workers 32 --gpus auto > "$out/plan_auto.txt" 2>&1; echo "exit $?" >> "$out/plan_auto.txt"
"$py" -m launcher plan --workers 32 --gpus 0 > "$out/plan_gpu0.txt" 2>&1; echo "exit $?" >> "$out/plan_gpu0.txt"
"$py" -m launcher check > "$out/check.txt" 2>&1; echo "exit $?" >> "$out/check.txt"
touch "$stop"
wait "$holder" "$orphan"
sleep 2
"$py" -m launcher gpus --no-docker --json > "$out/gpus_after.json" 2>&1
"$py" -m launcher plan --workers 32 --gpus auto > "$out/plan_after.txt" 2>&1; echo "exit $?" >> "$out/plan_after.txt"
rm -rf "$locks"
ls -l "$out"
