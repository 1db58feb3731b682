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


def two_core_bounds(table: list[dict[str, Any]], cores: int, groups: int | None = None) -> dict[int, float]:
    """Per worker count, the most the system can reach against one process on ``cores`` cores: its groups
    (the CPU plan's, or ``groups`` of them), each alone on a core with no transport and a master that costs
    nothing, step at one process's rate for their size: the sum of those rates over one process's rate at all
    the workers. Only where every group size was measured in the same table (``single_process_env_steps_per_s``)."""
    from launcher.gpu.placement import PlanRequest, cpu_plan, split_evenly

    single = {r["workers"]: r["single_process_env_steps_per_s"] for r in table}
    bounds: dict[int, float] = {}
    for w in single:
        sizes = (split_evenly(w, min(groups, w)) if groups else
                 [g.workers for g in cpu_plan(PlanRequest(workers=w), cores).groups])
        if len(sizes) <= cores and all(n in single for n in sizes):
            bounds[w] = sum(single[n] for n in sizes) / single[w]
    return bounds


def _plots(doc_dir: Path, actors: dict[str, Any] | None, tts: dict[str, Any] | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (doc_dir / IMG).mkdir(exist_ok=True)
    if actors:
        t = actors["table"]
        w = [r["workers"] for r in t]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=100)
        a1.plot(w, [r["system_env_steps_per_s"] for r in t], "o-", label="launcher (the plan's groups + master)")
        a1.plot(w, [r["single_process_env_steps_per_s"] for r in t], "s--", color="gray", label="one process")
        a1.set_ylabel("env-steps/s (median)")
        a1.set_title("throughput, learning off")
        a2.plot(w, [r["ratio"] for r in t], "o-", label="launcher / one process")
        bounds = two_core_bounds(t, int(actors["meta"].get("cores", 2)))
        bw = [x for x in w if x in bounds]
        a2.plot(bw, [bounds[x] for x in bw], "k--", lw=1, label="2-core bound")
        a2.plot(bw, [0.9 * bounds[x] for x in bw], "rv", ms=6, label="target: 0.9 x the bound")
        a2.set_ylabel("ratio (median of runs)")
        a2.set_title("actor efficiency")
        for ax in (a1, a2):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("workers")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle("scaling 1 -> 32 workers, CartPole-v1, 2 CPU cores", fontsize=10)
        fig.tight_layout()
        fig.savefig(doc_dir / IMG / "scaling.png")
        plt.close(fig)
    if tts:
        t = tts["table"]
        fig, ax = plt.subplots(figsize=(7.5, 3.8), dpi=100)
        ax.bar([r["contender"].replace("launcher ", "").replace(", ", "\n").replace(" (", "\n(") for r in t],
               [r["median_wall_s"] for r in t], color=["gray"] + ["tab:blue"] * (len(t) - 2) + ["tab:orange"])
        ax.tick_params(axis="x", labelsize=7)
        ax.set_ylabel("median seconds to mean return 475")
        ax.set_title("time to solve CartPole-v1")
        fig.tight_layout()
        fig.savefig(doc_dir / IMG / "time_to_solve.png")
        plt.close(fig)


def _first_step(results: Path) -> list[str]:
    """Section 1c: from `launcher up` to the first env step, with and without the numpy-made first policy."""
    d = _load(results, "start")
    out = ["## 1c. From `launcher up` to the first env step", ""]
    if not d:
        return out + ["Not measured yet: `python -m bench start`.", ""]
    out += [f"Command: `{d['command']}` (section `start`; measured {d['meta'].get('date', '?')}, commit "
            f"`{d['meta'].get('commit', '?')}`). `launcher up --backend process --workers {d['workers']} --env "
            "CartPole-v1`, seconds from starting the CLI to the first group playing (its log's `playing` line, right "
            "before its first env step) and to the first segment with a finished episode at the master. The master "
            "serves the groups a numpy-made first policy while TensorFlow loads (worker/early.py, the default) "
            f"against TensorFlow first (`WORKER_EARLY_START=0`); {d['reps']} interleaved pairs, medians. Target: the "
            "first env step within 1.5 s.", "",
            "| variant | median first step s | median first segment s | ratio vs TensorFlow first | runs (first step s) |",
            "|---|---|---|---|---|"]
    for r in d["table"]:
        runs = ", ".join(_f(x["first_step_s"], 2) for x in r["runs"])
        out.append(f"| {r['variant']} | {_f(r['median_first_step_s'], 2)} | {_f(r['median_first_segment_s'], 2)} | "
                   f"{_f(r['ratio_vs_tf_first'])} | {runs} |")
    return out + [""]


def _bracketed(data: dict[str, Any]) -> bool:
    """Whether an actors record measured its baseline on both sides of each system run."""
    return any("single_before_after" in r for row in data.get("table", []) for r in row.get("runs", []))


def _actor_table(d: dict[str, Any], groups: int | None = None) -> list[str]:
    """An actor-efficiency result (``python -m bench actors``) as a table: each row's rates, ratio, 2-core bound
    (:func:`two_core_bounds`) and the ratio's share of it, and the ratios of the runs."""
    bounds = two_core_bounds(d["table"], int(d["meta"].get("cores", 2)), groups)
    out = ["| workers | system env-steps/s | single process env-steps/s | ratio | 2-core bound | of the bound "
           "| ratios of the runs |", "|---|---|---|---|---|---|---|"]
    for r in d["table"]:
        each = ", ".join(_f(x["ratio"]) for x in r.get("runs", []))
        bound = bounds.get(r["workers"])
        out.append(f"| {r['workers']} | {_f(r['system_env_steps_per_s'], 0)} | "
                   f"{_f(r['single_process_env_steps_per_s'], 0)} | {_f(r['ratio'])} | {_f(bound)} | "
                   f"{_f(r['ratio'] / bound if bound else None)} | {each} |")
    return out


def _costly_envs(results: Path) -> list[str]:
    """Section 2c: actor efficiency on the envs whose step costs (``python -m bench actors --env ID``)."""
    found = sorted(results.glob("actors-*.json"))
    out = ["## 2c. Actor efficiency on envs that cost (Snake, Atari), learning off", ""]
    if not found:
        return out + ["Not measured yet: `python -m bench actors --env launcher/Snake-v0` (or `--env ALE/Pong-v5`).", ""]
    out += ["Each env's own command below. The system and the baseline as in section 2, on that env with PPO's",
            "segment length for it (`--set n_steps=N` on both sides) and the built-in network (Snake: the small",
            "CNN; Atari: the Nature CNN on 84×84×4 uint8 frames), acted in numpy. Target: ≥ 1.6 at 16 workers on 2",
            "cores (one process per core is the most a 2-core machine can give; an env that costs more per step",
            "leaves the fixed per-round costs less weight). With `--groups 2` the system runs put one group on each",
            "core: learning off, the learner needs no core of its own (the plan keeps one for an overlapped run's",
            "learner, which would leave one core's worth of actors: ratio ≤ 1 by construction). *2-core bound*: the",
            "groups, each alone on a core with no transport and a master that costs nothing, at one process's rate for",
            "their size, over one process's rate at all the workers; *of the bound*: the ratio over it.", ""]
    for path in found:
        d = json.loads(path.read_text())
        plan = f"--groups {d['groups']}" if d.get("groups") else "the plan's groups"
        out += [f"**{d['env']}** (n_steps {d['n_steps']}, {plan}, {d['steps']} env steps per system run, medians of "
                f"{d['reps']}; measured {d['meta'].get('date', '?')}, commit `{d['meta'].get('commit', '?')}`). "
                f"Command: `{d['command']}`", ""]
        out += _actor_table(d, d.get("groups")) + [""]
    return out


def _extras(results: Path) -> list[str]:
    d = _load(results, "extras")
    if not d:
        return []
    out = ["## 5b. `--with`: the derived image in one commit", "",
           f"Command: `{d['command']}` (section `extras`; not in `all`: it needs the worker image on the engine). "
           f"`build_extras_image` adding one small wheel ({d['wheel']}) to {d['base']} with `no_cache`, against "
           "the `docker build` of the multi-stage `docker/Dockerfile.extras` it replaced (in `bench/extras.py`, with "
           "the same three build labels), in turn, each image removed after it is timed. Engine storage driver: "
           f"`{d['storage_driver']}`; medians of {d['reps']}; measured {d['meta'].get('date', '?')}, commit "
           f"`{d['meta'].get('commit', '?')}`.", "",
           "| path | median s | ratio vs docker build | runs (s) |", "|---|---|---|---|"]
    for r in d["table"]:
        out.append(f"| {r['path']} | {_f(r['median_s'], 1)} | {_f(r['ratio_vs_docker_build'])} | "
                   f"{', '.join(_f(x, 1) for x in r['runs'])} |")
    return out + [""]


def write_report(results: Path, doc: Path) -> None:
    tts, actors, transport, memory, launch = (_load(results, n) for n in ("tts", "actors", "transport", "memory", "launch"))
    _plots(doc.parent, actors, tts)
    named = {n: d["meta"] for n, d in zip(("tts", "actors", "transport", "memory", "launch"),
                                          (tts, actors, transport, memory, launch)) if d}

    def machine(m: dict[str, Any]) -> str:
        return (f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores, {m.get('memory_gib', '?')} GiB, no GPU; "
                f"Python {m.get('python', '?')}; commit `{m.get('commit', '?')}`; measured {m.get('date', '?')}")

    out = ["# Benchmarks", "",
           "Every figure is a ratio against a baseline measured by the same script in the same run: these",
           "machines are shared and noisy, so absolute seconds drift while side-by-side ratios hold.", ""]
    if len({machine(m) for m in named.values()}) <= 1:
        out += [f"Hardware: {machine(next(iter(named.values()), {}))}."]
    else:  # sections measured at different times (or on different machines of this kind) say which is which
        out += ["Hardware, per section (the sections were measured at different times):", ""]
        out += [f"- `{n}`: {machine(m)}" for n, m in sorted(named.items(), key=lambda x: x[1].get("date", ""), reverse=True)]
    out += ["", "Reproduce everything: `.venv/bin/python -m bench all` (about 15 minutes; `--quick` for fewer seeds).",
           "Each section names its own command. Raw results: `bench/results/*.json`.", ""]
    out += ["## 1. Time to solve CartPole-v1 (mean return ≥ 475 over 100 episodes)", ""]
    if tts:
        out += [f"Command: `{tts['command']}` (section `tts`; seeds {tts['seeds']}, medians; wall time from the start of",
                "the process (`launcher up`, or the baseline's interpreter), TensorFlow import and start-up included for every",
                "contender). Baseline: single-process A2C (same network, 8 envs as one vector env exactly as a group steps",
                "them, numpy inference, TF train step, no transport) from `bench/a2c_baseline.py`. Launcher runs: process",
                "backend, 8 workers, defaults (collection overlapped with learning). Targets: PPO ≤ 0.5, A3C ≤ 0.8; PPO within",
                "150 k env steps.", "",
                "*start s*: from `launcher up` to the first segment at the master (CLI, TensorFlow import, model and",
                "trace, first collection).", "",
                "| contender | median wall s | runs (s) | median start s | median env steps | solved | ratio vs baseline |",
                "|---|---|---|---|---|---|---|"]
        for r in tts["table"]:
            runs = ", ".join(_f(x["wall_s"], 1) for x in r.get("runs", []))
            out.append(f"| {r['contender']} | {_f(r['median_wall_s'], 1)} | {runs} | {_f(r.get('median_start_s'), 1)} | "
                       f"{_f(r['median_env_steps'], 0)} | {r['solved']} | {_f(r['ratio_vs_baseline'])} |")
        out += ["", f"![time to solve]({IMG}/time_to_solve.png)", ""]
    else:
        out += ["Not measured yet: `python -m bench tts`.", ""]
    acting = _load(results, "acting")
    if acting:
        out += ["## 1b. Acting in numpy or in TensorFlow: the same MLP", "",
                f"Command: `{acting['command']}` (section `acting`). `launcher up --backend process --algo ppo` on",
                f"CartPole-v1, {acting['workers']} workers (one group), {acting['steps']} env steps, `--set epochs=0`",
                "(learning off: acting and transport alone), with `--acting numpy` (the program converted from the",
                "Keras model, no TensorFlow in the group) and `--acting tensorflow` (the group builds the Keras model",
                f"and calls it compiled on the batch of envs); {acting['reps']} interleaved pairs, medians.", "",
                "| acting | env-steps/s | ratio vs numpy | runs |", "|---|---|---|---|"]
        for r in acting["table"]:
            out.append(f"| {r['acting']} | {_f(r['env_steps_per_s'], 0)} | {_f(r['ratio_vs_numpy'])} | "
                       f"{', '.join(_f(x, 0) for x in r['runs'])} |")
        out += [""]
    out += _first_step(results)
    out += ["## 2. Actor efficiency and scaling, 1 to 32 workers", ""]
    if actors:
        out += [f"Command: `{actors['command']}` (section `actors`). System: `launcher up --backend process --algo ppo` on",
                f"CartPole-v1 for {actors['steps']} env steps with `--set epochs=0` (the master re-broadcasts weights",
                "without training, so this isolates acting, transport and the rounds; learning-bound speed is sections 1",
                "and 2b); rate from the master's metrics after the first steps. Baseline: one process stepping the same",
                "number of envs the same way (one `make_vector_env`, gymnasium's numpy CartPole; the same numpy policy),",
                "no transport, no learning" + ("; run just before and just after each system run and the two averaged"
                                               " (this machine's speed drifts)" if _bracketed(actors) else "") +
                f". Medians of {actors.get('reps', 1)} interleaved runs. *2-core bound*: the",
                "plan's groups (one up to 16 workers, the learner keeping a core; two of 16 at 32), each alone on a core",
                "with no transport, at one process's rate for their size, over one process's rate at all the workers",
                "(1.0 while one group plays). Target (issue 28): ≥ 0.9 × the bound at 8 and at 32 workers.", ""]
        out += _actor_table(actors) + ["", f"![scaling]({IMG}/scaling.png)", ""]
    else:
        out += ["Not measured yet: `python -m bench actors`.", ""]
    out += _costly_envs(results)
    learning, update = _load(results, "learning"), _load(results, "update")
    out += ["## 2b. While learning: env-steps/s against learning off", ""]
    if learning:
        out += [f"Command: `{learning['command']}` (section `learning`). `launcher up --backend process --workers "
                f"{learning['workers']}` on CartPole-v1 for {learning['steps']} env steps: learning off (`--set epochs=0`),",
                "PPO learning with the default overlapped collection, and PPO with `--set sync=true` (the synchronous",
                f"round). Medians of {learning['reps']} interleaved runs. Target: learning on ≥ 0.8× learning off.", "",
                "| variant | env-steps/s | ratio vs learning off | runs |", "|---|---|---|---|"]
        for r in learning["table"]:
            out.append(f"| {r['variant']} | {_f(r['env_steps_per_s'], 0)} | {_f(r['ratio_vs_learning_off'])} | "
                       f"{', '.join(_f(x, 0) for x in r['runs'])} |")
        out.append("")
    else:
        out += ["Not measured yet: `python -m bench learning`.", ""]
    out += ["## 2c. The PPO update on this CPU: one graph call, with and without XLA", ""]
    if update:
        out += [f"Command: `{update['command']}` (section `update`). `PPOLearner.update` on CartPole rounds of 480–512",
                "samples (8 workers × 64 steps less masked reset rows), 4 epochs × 4 minibatches, in a fresh process:",
                "the first call (with XLA: compilation) and the median of the next 60 updates; medians of "
                f"{update['reps']} processes.", "",
                "| TF threads | XLA (`jit_compile`) | first call ms | update ms |", "|---|---|---|---|"]
        for r in update["table"]:
            out.append(f"| {r['threads']} | {'yes' if r['xla'] else 'no'} | {_f(r['first_call_ms'], 0)} | {_f(r['update_ms'])} |")
        out.append("")
    else:
        out += ["Not measured yet: `python -m bench update`.", ""]
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
        out += ["",
                "Since protocol v2 every frame after the handshake is sealed: a sequence number and an HMAC-SHA256 over",
                "the SHA-256 of the payload, per-connection keys (docs/reliability.md). The receiver hashes every byte, so",
                "on 2 cores the MAC costs more than the copy: the 20 MB broadcast went from 0.96× raw (protocol v1, frames",
                "unsealed) to the figure above.", ""]
        raw20 = next((r["raw_ms"] for r in transport["table"] if r["bytes"] >= 1_000_000), None)
        if transport.get("hashes") and raw20:
            out += ["What authenticating every byte of 20 MB costs the receiver, measured by the same command (one",
                    "thread unless said; `pip install -e .[bench]` adds the two outside hashlib). *Best ratio*: raw /",
                    "(raw + this cost), the most a protocol that runs it on every received byte could reach here, even",
                    "with nothing else added:", "",
                    "| what, over 20 MB | ms | GB/s | best protocol vs raw |", "|---|---|---|---|"]
            for h in transport["hashes"]:
                out.append(f"| {h['what']} | {_f(h['ms'])} | {_f(h['gb_s'])} | {_f(raw20 / (raw20 + h['ms']))}× |")
            budget = raw20 / 0.9 - raw20
            macs = [h for h in transport["hashes"] if "memcpy" not in h["what"]]
            best = max(macs, key=lambda h: h["gb_s"])
            copy = next((h for h in transport["hashes"] if "memcpy" in h["what"]), None)
            out += ["", f"The ≥ 0.9× target of issue 14 leaves {_f(budget)} ms for authenticating 20 MB: a MAC running at "
                        f"{_f(20 / budget, 0)} GB/s, {_f(20 / budget / best['gb_s'], 1)}× the fastest measured here "
                        f"({best['what']})" + (f", and faster than this machine copies memory ({_f(copy['gb_s'])} GB/s)"
                                               if copy and copy["gb_s"] < 20 / budget else "") + ".",
                    "With every frame authenticated (issue 14, item 4) the target cannot be met on this machine; the",
                    "fastest hash would lift the figure to about its *best ratio* above, for a compiled dependency on",
                    "every image. SHA-256 (hashlib, no dependency) stays.", ""]
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
    out += _extras(results)
    extra = Path(__file__).resolve().parent / "notes.md"
    if extra.exists():
        out += [extra.read_text()]
    from bench.peers import report as peers_report

    out += peers_report(_load(results, "peers"))
    doc.write_text("\n".join(out).rstrip() + "\n")
