"""Unshard a 1.5 GiB DCP (world size 2) with ckptkit vs torch's ``dcp_to_torch_save`` vs ``cp -r``.

Generates (once, cached in ``benchmarks/out/``) two fp32 DCP checkpoints of 24 x [16384, 1024]
tensors written by torch's own ``dcp.save`` from 2 spawned gloo ranks holding DTensors, one
row-sharded (``Shard(0)``) and one column-sharded (``Shard(1)``). Then measures in fresh
processes: ``cp -r`` of the directory (disk floor), a Python buffer-reusing copy (the
user-space floor), ``dcp_to_torch_save`` (anchor), ``ckptkit.unshard(to="safetensors")`` and
``ckptkit.unshard(to="torch")``; checks once that ckptkit's outputs are bit-equal to torch's.
Usage: ``python benchmarks/bench_unshard.py [--repeat N] [--layouts rows cols]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _measure import (  # noqa: E402
    OUT_DIR,
    Run,
    cached_input,
    environment,
    load_line,
    markdown_table,
    median,
    progress,
    python_argv,
    ratio,
    repeat_interleaved,
    run,
    runs_json,
    write_json,
)

N_TENSORS = 24
SHAPE = (16384, 1024)  # float32: 64 MiB per tensor, 1.5 GiB in all
WORLD_SIZE = 2
LAYOUTS = {"rows": 0, "cols": 1}  # name -> the dimension DTensors are sharded along
GENERATOR_VERSION = 1
TENSOR_MIB = SHAPE[0] * SHAPE[1] * 4 / 2**20
TOTAL_MIB = N_TENSORS * TENSOR_MIB
GOAL_VS_TORCH = 0.15  # ckptkit wall <= 0.15 x dcp_to_torch_save
GOAL_VS_CP = 1.3  # ckptkit wall <= 1.3 x cp -r
GOAL_RSS_MIB = TENSOR_MIB + 64  # peak RSS above the baseline <= largest tensor + 64 MiB
WORK = OUT_DIR / "unshard_work"  # outputs of the measured runs, deleted after each one

CP = "cp -r (disk floor)"
PY_COPY = "python read+write copy"
TORCH = "torch dcp_to_torch_save"
SAFETENSORS = "ckptkit unshard to=safetensors"
TORCH_SAVE = "ckptkit unshard to=torch"
TOOLS = [CP, PY_COPY, TORCH, SAFETENSORS, TORCH_SAVE]
BASE_CKPTKIT = "baseline: import ckptkit + open"
BASE_CKPTKIT_TORCH = "baseline: import ckptkit, torch + open"
BASE_TORCH = "baseline: import torch.distributed.checkpoint"
BASELINES = [BASE_CKPTKIT, BASE_CKPTKIT_TORCH, BASE_TORCH]


# -- input -----------------------------------------------------------------------------------


def key_name(i: int) -> str:
    """The key of tensor ``i`` inside the ``model`` group."""
    return f"layers.{i}.weight"


def full_tensor(i: int):
    """Tensor ``i`` in full: seeded normal values, so every run generates the same checkpoint."""
    import torch

    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(i))


def _save_rank(rank: int, world_size: int, path: str, shard_dim: int) -> None:
    """Rank body of :func:`write_source`: DTensors scattered from rank 0, saved by ``dcp.save``."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    model = {}
    for i in range(N_TENSORS):
        # distribute_tensor scatters rank 0's values; the other ranks only supply the shape
        full = full_tensor(i) if rank == 0 else torch.empty(SHAPE)
        model[key_name(i)] = distribute_tensor(full, mesh, [Shard(shard_dim)])
        del full
    dcp.save({"model": model}, storage_writer=FileSystemWriter(path))


def write_source(path: Path, shard_dim: int) -> None:
    """Write one benchmark checkpoint with torch's DCP from ``WORLD_SIZE`` spawned gloo ranks."""
    from ckptkit.examples import _spawn

    _spawn(_save_rank, WORLD_SIZE, str(path), shard_dim)


def ensure_source(layout: str) -> Path:
    """The cached checkpoint for ``layout``, generated in a child process if missing."""
    params = {
        "tensors": N_TENSORS,
        "shape": list(SHAPE),
        "shard_dim": LAYOUTS[layout],
        "world_size": WORLD_SIZE,
        "generator": GENERATOR_VERSION,
    }
    return cached_input(
        OUT_DIR / f"unshard_{layout}_{N_TENSORS}x{SHAPE[0]}x{SHAPE[1]}",
        params,
        f"from bench_unshard import write_source\nwrite_source(out, {LAYOUTS[layout]})",
        f"dcp.save from {WORLD_SIZE} ranks",
    )


def source_mib(directory: Path) -> float:
    """Bytes of the checkpoint's files, in MiB."""
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file()) / 2**20


# -- measurements ----------------------------------------------------------------------------

_TIMED = """
t0, c0 = time.perf_counter(), time.process_time()
{body}
t1, c1 = time.perf_counter(), time.process_time()
_report(op_s=t1 - t0, op_cpu_s=c1 - c0, torch_loaded=sys.modules.get("torch") is not None)
"""


def _child(imports: str, body: str) -> list[str]:
    """A python child that imports first, then times ``body`` alone."""
    return python_argv(imports + "\n" + _TIMED.format(body=body))


def tool_argv(tool: str, src: Path, dst: Path) -> list[str]:
    """The command measuring ``tool`` on checkpoint ``src``, writing into ``dst``."""
    if tool == CP:
        return ["cp", "-r", str(src), str(dst)]
    if tool == PY_COPY:
        here = str(Path(__file__).resolve().parent)
        return _child(
            f"sys.path.insert(0, {here!r})\nfrom bench_unshard import copy_files",
            f"copy_files({str(src)!r}, {str(dst)!r})",
        )
    if tool == TORCH:
        return _child(
            "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save",
            f"dcp_to_torch_save({str(src)!r}, {str(dst / 'model.pt')!r})",
        )
    target = "safetensors" if tool == SAFETENSORS else "torch"
    return _child(
        "import ckptkit",
        f"ckptkit.unshard({str(src)!r}, {str(dst)!r}, to={target!r}, progress=False)",
    )


def copy_files(src: str, dst: str, buffer_mib: int = 8) -> None:
    """What any user-space converter must at least do: read every byte into a reused buffer and
    write it out (``cp`` itself goes faster: it copies in the kernel with ``copy_file_range``)."""
    buffer = bytearray(buffer_mib << 20)
    view = memoryview(buffer)
    for name in sorted(os.listdir(src)):
        with open(os.path.join(src, name), "rb") as f, open(os.path.join(dst, name), "wb") as out:
            while n := f.readinto(buffer):
                out.write(view[:n])


def baseline_argv(name: str, src: Path) -> list[str]:
    """The interpreter state each tool starts from: its imports (and for ckptkit, ``open``)."""
    imports = {
        BASE_CKPTKIT: "import ckptkit",
        BASE_CKPTKIT_TORCH: "import ckptkit, torch",
        BASE_TORCH: "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save",
    }[name]
    body = "pass" if name == BASE_TORCH else f"ckptkit.open({str(src)!r}).catalog"
    return _child(imports, body)


def output_dir(layout: str, tool: str) -> Path:
    """Where ``tool`` writes for ``layout`` (kept after the last round for the check)."""
    return WORK / f"{layout}-{TOOLS.index(tool)}"


def remove(path: Path) -> None:
    """Delete a measured output and flush, so the next run starts with no writeback pending."""
    shutil.rmtree(path, ignore_errors=True)
    os.sync()


def jobs(sources: dict[str, Path], repeat: int) -> dict[str, Callable[[], Run]]:
    """The child processes to measure, by name; each cleans up its output after itself,
    except on its last round, whose outputs :func:`verify` compares."""
    out: dict[str, Callable[[], Run]] = {}
    calls: dict[str, int] = {}
    for name in BASELINES:
        out[name] = lambda name=name: run(baseline_argv(name, next(iter(sources.values()))))
    for layout, src in sources.items():
        for tool in TOOLS:
            name = f"{layout}: {tool}"

            def job(name=name, layout=layout, src=src, tool=tool) -> Run:
                calls[name] = calls.get(name, 0) + 1
                dst = output_dir(layout, tool)
                remove(dst)
                if tool != CP:
                    dst.mkdir(parents=True)
                result = run(tool_argv(tool, src, dst))
                if tool in (CP, PY_COPY) or calls[name] < repeat:
                    remove(dst)
                return result

            out[name] = job
    return out


def verify(layout: str) -> dict[str, Any]:
    """Compare ckptkit's outputs of the last round with ``dcp_to_torch_save``'s, in a child."""
    torch_out = output_dir(layout, TORCH) / "model.pt"
    pt = output_dir(layout, TORCH_SAVE) / "model.pt"
    st = output_dir(layout, SAFETENSORS) / "model.safetensors"
    code = f"""
        import torch
        from safetensors import safe_open
        expected = torch.load({str(torch_out)!r}, mmap=True, weights_only=True)["model"]
        ours = torch.load({str(pt)!r}, mmap=True, weights_only=True)
        checked, bad = 0, []
        with safe_open({str(st)!r}, framework="pt") as st:
            assert set(st.keys()) == set(ours) == set(expected), "keys differ"
            for key, want in expected.items():
                for got in (ours[key], st.get_tensor(key)):
                    same = got.dtype == want.dtype and got.shape == want.shape and torch.equal(
                        got.view(torch.int32), want.view(torch.int32))
                    if not same:
                        bad.append(key)
                    checked += 1
        _report(checked=checked, bad=bad, keys=len(expected))
        """
    result = run(python_argv(code)).report
    for tool in (TORCH, SAFETENSORS, TORCH_SAVE):
        remove(output_dir(layout, tool))
    return result


# -- report ----------------------------------------------------------------------------------


def summarize(runs: dict[str, list[Run]]) -> dict[str, dict[str, float]]:
    """Medians per measurement: timed step (python children; cp: the whole process), CPU, RSS."""
    stats: dict[str, dict[str, float]] = {}
    for name, results in runs.items():
        is_python = bool(results[0].report)
        stats[name] = {
            "op_s": median([r.report["op_s"] if is_python else r.wall_s for r in results]),
            "process_wall_s": median([r.wall_s for r in results]),
            "op_cpu_s": median([r.report["op_cpu_s"] if is_python else r.cpu_s for r in results]),
            "process_cpu_s": median([r.cpu_s for r in results]),
            "peak_rss_mib": median([r.peak_rss_mib for r in results]),
        }
        if is_python:
            stats[name]["torch_loaded"] = any(r.report["torch_loaded"] for r in results)
    return stats


def baseline_for(tool: str, stats: dict[str, dict[str, float]], torch_loaded: bool) -> str | None:
    """The baseline row ``tool`` starts from: its imports (torch's too when the run imported
    it: ``to="torch"`` pickles torch's own rebuild functions), before touching tensor data."""
    if tool in (CP, PY_COPY):
        return None
    if tool == TORCH:
        return BASE_TORCH
    return BASE_CKPTKIT_TORCH if torch_loaded else BASE_CKPTKIT


def report(stats: dict[str, dict[str, float]], layouts: list[str], repeat: int) -> tuple[str, dict]:
    """The markdown table and the goal lines, plus goal verdicts per layout and target."""
    headers = [
        "measurement",
        "wall s",
        "process wall s",
        "CPU s",
        "peak RSS MiB",
        "RSS over baseline MiB",
        "wall / dcp_to_torch_save",
        "wall / cp",
        "CPU / dcp_to_torch_save",
        "CPU / cp",
    ]
    rows = []
    for name in BASELINES:
        s = stats[name]
        rows.append(
            [name, "—", f"{s['process_wall_s']:.2f}", f"{s['process_cpu_s']:.2f}",
             f"{s['peak_rss_mib']:.0f}", "—", "—", "—", "—", "—"]
        )  # fmt: skip
    goals: dict[str, Any] = {}
    lines = []
    for layout in layouts:
        cp, anchor = stats[f"{layout}: {CP}"], stats[f"{layout}: {TORCH}"]
        for tool in TOOLS:
            s = stats[f"{layout}: {tool}"]
            base = baseline_for(tool, stats, bool(s.get("torch_loaded")))
            over = None if base is None else s["peak_rss_mib"] - stats[base]["peak_rss_mib"]
            s["baseline"] = base
            s["rss_over_baseline_mib"] = over
            rows.append(
                [
                    f"{layout}: {tool}",
                    f"{s['op_s']:.2f}",
                    f"{s['process_wall_s']:.2f}",
                    f"{s['op_cpu_s']:.2f}",
                    f"{s['peak_rss_mib']:.0f}",
                    "—" if over is None else f"{over:.0f}",
                    ratio(s["op_s"], anchor["op_s"]),
                    ratio(s["op_s"], cp["op_s"]),
                    ratio(s["op_cpu_s"], anchor["op_cpu_s"]),
                    ratio(s["op_cpu_s"], cp["op_cpu_s"]),
                ]
            )
            if tool not in (SAFETENSORS, TORCH_SAVE):
                continue
            vs_torch = s["op_s"] / anchor["op_s"]
            vs_cp = s["op_s"] / cp["op_s"]
            cpu_vs_torch = s["op_cpu_s"] / anchor["op_cpu_s"]
            cpu_vs_cp = s["op_cpu_s"] / cp["op_cpu_s"]
            g = {
                "vs_dcp_to_torch_save": {"value": vs_torch, "goal": GOAL_VS_TORCH},
                "vs_cp": {"value": vs_cp, "goal": GOAL_VS_CP},
                "rss_over_baseline_mib": {"value": over, "goal": GOAL_RSS_MIB},
            }
            for item in g.values():
                item["met"] = item["value"] <= item["goal"]
            goals[f"{layout}: {tool}"] = g
            g["cpu_vs_dcp_to_torch_save"] = {"value": cpu_vs_torch}
            g["cpu_vs_cp"] = {"value": cpu_vs_cp}

            def verdict(item: dict) -> str:
                return "MET" if item["met"] else "MISSED"

            lines.append(
                f"- {layout}, {tool}: wall / dcp_to_torch_save {vs_torch:.3f} "
                f"(goal <= {GOAL_VS_TORCH}: {verdict(g['vs_dcp_to_torch_save'])}; CPU ratio "
                f"{cpu_vs_torch:.3f}); wall / cp {vs_cp:.2f} (goal <= {GOAL_VS_CP}: "
                f"{verdict(g['vs_cp'])}; CPU ratio {cpu_vs_cp:.2f}); RSS over baseline "
                f"{over:.0f} MiB over `{base.removeprefix('baseline: ')}` (goal <= "
                f"{GOAL_RSS_MIB:.0f}: {verdict(g['rss_over_baseline_mib'])})"
            )
            if base != BASE_CKPTKIT:
                plain = s["peak_rss_mib"] - stats[BASE_CKPTKIT]["peak_rss_mib"]
                lines.append(
                    f"  (over `import ckptkit + open` alone: {plain:.0f} MiB, the torch import "
                    "included)"
                )
        torch_over = anchor["peak_rss_mib"] - stats[BASE_TORCH]["peak_rss_mib"]
        lines.append(
            f"- {layout}, torch dcp_to_torch_save: RSS over its baseline {torch_over:.0f} MiB "
            f"= {torch_over / TOTAL_MIB:.2f} x the checkpoint ({TOTAL_MIB:.0f} MiB)"
        )
    text = [
        f"Medians of {repeat} fresh processes each, run round-robin after one warm-up `cp -r`",
        "per layout (so the sources sit in the page cache; outputs are deleted unflushed, so this",
        "measures CPU and memory bandwidth, not the disk). `wall s` / `CPU s` time only the",
        "conversion inside the child (imports excluded; `cp`: the whole process, which copies in",
        "the kernel with copy_file_range); `process wall s` includes interpreter start and",
        "imports. On a busy machine wall time mostly measures the wait for a CPU: the CPU ratios",
        "are the steadier reading. Peak RSS is the child's ru_maxrss; RSS over baseline subtracts",
        "the matching baseline row: `import ckptkit + open`, plus torch for ckptkit runs that",
        "imported torch; torch's own import for dcp_to_torch_save. Goal RSS = largest tensor",
        f"({TENSOR_MIB:.0f} MiB) + 64 MiB.",
        "",
        markdown_table(headers, rows),
        "",
        *lines,
    ]
    return "\n".join(text), goals


def main() -> None:
    """Generate the inputs if needed, measure, verify, print the table and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement (median)")
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    args = parser.parse_args()

    env_before = environment()
    start = time.perf_counter()
    sources = {layout: ensure_source(layout) for layout in args.layouts}
    sizes = {layout: source_mib(path) for layout, path in sources.items()}
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    try:
        for layout, src in sources.items():  # warm the page cache with the sources
            progress(f"warm-up: cp -r {src.name} ({sizes[layout]:.0f} MiB)")
            remove(WORK / "warmup")
            subprocess.run(["cp", "-r", str(src), str(WORK / "warmup")], check=True)
            remove(WORK / "warmup")
        runs = repeat_interleaved(jobs(sources, args.repeat), args.repeat)
        checks = {}
        for layout in args.layouts:
            progress(f"verifying {layout}: ckptkit outputs vs dcp_to_torch_save")
            checks[layout] = verify(layout)
            if checks[layout]["bad"] or checks[layout]["keys"] != N_TENSORS:
                raise SystemExit(f"{layout}: outputs differ from dcp_to_torch_save: {checks}")
    finally:
        shutil.rmtree(WORK, ignore_errors=True)

    stats = summarize(runs)
    text, goals = report(stats, args.layouts, args.repeat)
    print(
        f"## bench_unshard: {N_TENSORS} x fp32 {list(SHAPE)} = {TOTAL_MIB:.0f} MiB, DCP from "
        f"{WORLD_SIZE} ranks ("
        + ", ".join(f"{k}: {sizes[k]:.0f} MiB on disk" for k in args.layouts)
        + ")\n"
    )
    print(text)
    print(
        "\nChecked: "
        + "; ".join(
            f"{layout}: {c['keys']} tensors x (model.pt, model.safetensors) bit-equal to "
            "dcp_to_torch_save"
            for layout, c in checks.items()
        )
    )
    torch_free = {name: not s["torch_loaded"] for name, s in stats.items() if SAFETENSORS in name}
    print(f"to=safetensors ran without importing torch: {torch_free}")
    print(load_line(env_before))
    progress(f"total {time.perf_counter() - start:.0f} s")
    write_json(
        OUT_DIR / "bench_unshard.json",
        {
            "benchmark": "bench_unshard",
            "params": {
                "tensors": N_TENSORS,
                "shape": list(SHAPE),
                "world_size": WORLD_SIZE,
                "layouts": {k: LAYOUTS[k] for k in args.layouts},
                "source_mib": sizes,
            },
            "repeat": args.repeat,
            "environment": {"before": env_before, "after_loadavg": list(os.getloadavg())},
            "medians": stats,
            "goals": goals,
            "checks": checks,
            "runs": runs_json(runs),
        },
    )
    progress(f"wrote {OUT_DIR / 'bench_unshard.json'}")


if __name__ == "__main__":
    main()
