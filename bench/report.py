"""Write docs/benchmarks.md (and its plots) from bench/results/*.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

IMG = "img"


def _load(results: Path, name: str) -> dict[str, Any] | None:
    path = results / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _f(x: Any, nd: int = 2) -> str:
    return "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def _plots(doc_dir: Path, actors: dict[str, Any] | None, tts: dict[str, Any] | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (doc_dir / IMG).mkdir(exist_ok=True)
    if actors:
        t = actors["table"]
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
        ax.plot([r["workers"] for r in t], [r["ratio"] for r in t], "o-", label="system / single process")
        ax.axhline(0.8, color="gray", ls="--", lw=1, label="target 0.8")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("workers")
        ax.set_ylabel("env-steps/s ratio")
        ax.set_title("actor efficiency (CartPole-v1, PPO, 2 cores)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(doc_dir / IMG / "actor_efficiency.png")
        plt.close(fig)
    if tts:
        t = tts["table"]
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
        ax.bar([r["contender"].replace(", ", "\n") for r in t], [r["median_wall_s"] for r in t], color=["gray", "tab:blue", "tab:orange"])
        ax.set_ylabel("median seconds to mean return 475")
        ax.set_title("time to solve CartPole-v1")
        fig.tight_layout()
        fig.savefig(doc_dir / IMG / "time_to_solve.png")
        plt.close(fig)


def write_report(results: Path, doc: Path) -> None:
    tts, actors, transport, memory, launch = (_load(results, n) for n in ("tts", "actors", "transport", "memory", "launch"))
    _plots(doc.parent, actors, tts)
    metas = [d["meta"] for d in (tts, actors, transport, memory, launch) if d]
    meta = metas[0] if metas else {}
    out = ["# Benchmarks", "",
           "Every figure is a ratio against a baseline measured by the same script in the same run: these",
           "machines are shared and noisy, so absolute seconds drift while side-by-side ratios hold.",
           "", f"Hardware: {meta.get('cpu', '?')}, {meta.get('cores', '?')} cores, {meta.get('memory_gib', '?')} GiB, "
           f"no GPU; Python {meta.get('python', '?')}; commit `{meta.get('commit', '?')}`; measured {meta.get('date', '?')}.",
           "", "Reproduce everything: `.venv/bin/python -m bench all` (about 15 minutes; `--quick` for fewer seeds).",
           "Each section names its own command. Raw results: `bench/results/*.json`.", ""]
    out += ["## 1. Time to solve CartPole-v1 (mean return ≥ 475 over 100 episodes)", ""]
    if tts:
        out += [f"Command: `{tts['command']}` (section `tts`; seeds {tts['seeds']}, medians; wall time from process start,",
                "TensorFlow import included for every contender). Baseline: single-process A2C (same network, 8 vectorised",
                "envs, numpy inference, TF train step, no transport) from `bench/a2c_baseline.py`. Target: ratio ≤ 1.0, stretch ≤ 0.6.", "",
                "| contender | median wall s | median env steps | solved | ratio vs baseline |", "|---|---|---|---|---|"]
        for r in tts["table"]:
            out.append(f"| {r['contender']} | {_f(r['median_wall_s'], 1)} | {_f(r['median_env_steps'], 0)} | {r['solved']} | {_f(r['ratio_vs_baseline'])} |")
        out += ["", f"![time to solve]({IMG}/time_to_solve.png)", ""]
    else:
        out += ["Not measured yet: `python -m bench tts`.", ""]
    out += ["## 2. Actor efficiency", ""]
    if actors:
        out += [f"Command: `{actors['command']}` (section `actors`). System: `launcher up --backend process --algo ppo` on",
                f"CartPole-v1 for {actors['steps']} env steps with `--set epochs=0` (the master re-broadcasts weights",
                "without training, so this isolates acting, transport and the PPO round barrier; learning-bound speed is",
                "section 1); rate from the master's metrics after the first steps. Baseline: one process stepping the",
                "same number of envs with the same numpy policy, no transport and no learning. Target ≥ 0.8 at 8 and 32 workers.", "",
                "| workers | system env-steps/s | single process env-steps/s | ratio |", "|---|---|---|---|"]
        for r in actors["table"]:
            out.append(f"| {r['workers']} | {_f(r['system_env_steps_per_s'], 0)} | {_f(r['single_process_env_steps_per_s'], 0)} | {_f(r['ratio'])} |")
        out += ["", f"![actor efficiency]({IMG}/actor_efficiency.png)", ""]
    else:
        out += ["Not measured yet: `python -m bench actors`.", ""]
    out += ["## 3. Transport: one weight broadcast", ""]
    if transport:
        out += [f"Command: `{transport['command']}` (section `transport`). Loopback TCP. *Protocol*: an authenticated",
                "connection, a WEIGHTS frame encoded once (as the master does per version), sent with `sendmsg`,",
                "received straight into the group's spare weight arrays (`recv_into` per array, no copy) and swapped in.",
                "*Raw*: one preallocated buffer, 4-byte length, `sendall` / `recv_into`. *Pipe*: `multiprocessing.Pipe`",
                "with pickle (the classic recipe). Medians. Target ≥ 0.7× raw at 20 MB.", "",
                "| size | raw ms | protocol ms | pickling Pipe ms | protocol GB/s | protocol vs raw | protocol vs Pipe |",
                "|---|---|---|---|---|---|---|"]
        for r in transport["table"]:
            out.append(f"| {r['size']} | {_f(r['raw_ms'], 3)} | {_f(r['protocol_ms'], 3)} | {_f(r['pipe_ms'], 3)} | "
                       f"{_f(r['protocol_gb_s'])} | {_f(r['protocol_vs_raw'])}× | {_f(r['protocol_vs_pipe'])}× |")
        out.append("")
    else:
        out += ["Not measured yet: `python -m bench transport`.", ""]
    out += ["## 4. Memory of 32 workers", ""]
    if memory:
        m = memory
        out += [f"Command: `{m['command']}` (section `memory`). Launcher: `launcher up --backend process --workers 32`",
                f"({m['launcher_processes']} processes: the master and {m['launcher_groups']} groups) once training.",
                "Classic layout: 32 processes each importing TensorFlow and building the model. PSS counts shared pages",
                "once (the honest total); RSS counts them in every process. Target ≤ 0.25×.", "",
                "| | processes | PSS MiB | RSS MiB |", "|---|---|---|---|",
                f"| launcher | {m['launcher_processes']} | {_f(m['launcher_pss_mib'], 0)} | {_f(m['launcher_rss_mib'], 0)} |",
                f"| classic | {m['classic_processes']} | {_f(m['classic_pss_mib'], 0)} | {_f(m['classic_rss_mib'], 0)} |",
                f"| ratio | | {_f(m['ratio_pss'], 3)} | {_f(m['ratio_rss'], 3)} |", ""]
    else:
        out += ["Not measured yet: `python -m bench memory`.", ""]
    out += ["## 5. Launch latency", ""]
    if launch:
        out += [f"Command: `{launch['command']}` (section `launch`). Seconds from starting `launcher up --workers 32` to",
                "all 32 workers connected to the master (from status.json), image present. Target ≤ 10 s.", "",
                "| backend | runs (s) | median s |", "|---|---|---|",
                f"| process | {', '.join(_f(x, 2) for x in launch['seconds'])} | {_f(launch['median_s'], 2)} |"]
        docker = (Path(__file__).resolve().parent.parent / "docs" / "docker-backend.md")
        out += ["", "Docker backend: see [docker-backend.md](docker-backend.md) for its launch latency." if docker.exists() else "", ""]
    else:
        out += ["Not measured yet: `python -m bench launch`.", ""]
    extra = Path(__file__).resolve().parent / "notes.md"
    if extra.exists():
        out += [extra.read_text()]
    doc.write_text("\n".join(out).rstrip() + "\n")
