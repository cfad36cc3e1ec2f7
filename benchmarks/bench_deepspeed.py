"""Unshard DeepSpeed ZeRO checkpoints with ckptkit vs DeepSpeed's own ``zero_to_fp32``.

Generates (once, cached in ``benchmarks/out/``) a ZeRO-2 and a ZeRO-3 checkpoint written by
DeepSpeed itself (``engine.save_checkpoint`` after one Adam step, 2 CPU ranks over gloo under
torchrun) of ``--layers`` x ``Linear(--width, --width)``, and also takes the largest checked-in
fixture (``tests/fixtures/deepspeed_zero3_ws4``, 4 ranks, a few KiB) as the small case. Then
measures in fresh processes, round-robin: ``convert_zero_checkpoint_to_fp32_state_dict`` writing
``pytorch_model.bin`` (anchor) and ``model.safetensors``, and ``ckptkit.unshard(groups="model")``
``to="safetensors"`` and ``to="torch"``; checks once that ckptkit's tensors are bit-equal to
DeepSpeed's. DeepSpeed runs from its own venv (``benchmarks/out/dsvenv``, created on first use
and reusing this interpreter's torch) or ``--deepspeed-python PATH``.
Usage: ``python benchmarks/bench_deepspeed.py [--repeat N] [--layers N] [--width N]
[--cases zero2 zero3 fixture] [--deepspeed-python PATH]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _measure import (  # noqa: E402
    OUT_DIR,
    REPO_ROOT,
    Run,
    cached_input,
    child_env,
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

DEEPSPEED_VERSION = "0.19.8"
DS_VENV = OUT_DIR / "dsvenv"
WORLD_SIZE = 2
LAYERS = 24  # default model: 24 x Linear(2048, 2048), 101M parameters, 384 MiB of fp32 masters
WIDTH = 2048
GENERATED = {"zero2": 2, "zero3": 3}  # case name -> ZeRO stage
FIXTURE = "fixture"
FIXTURE_DIR = REPO_ROOT / "tests" / "fixtures" / "deepspeed_zero3_ws4" / "checkpoint"
CASES = [*GENERATED, FIXTURE]
GENERATOR_VERSION = 1
RSS_SLACK_MIB = 64  # goal: peak RSS over the baseline <= largest tensor + 64 MiB
GOAL_VS_ANCHOR = 1.0  # goal: ckptkit wall (and CPU) <= zero_to_fp32's
WORK = OUT_DIR / "deepspeed_work"  # outputs of the measured runs, deleted after each one

ANCHOR = "zero_to_fp32 -> pytorch_model.bin"
ANCHOR_ST = "zero_to_fp32 -> model.safetensors"
SAFETENSORS = "ckptkit unshard to=safetensors"
TORCH_SAVE = "ckptkit unshard to=torch"
TOOLS = [ANCHOR, ANCHOR_ST, SAFETENSORS, TORCH_SAVE]
OUTPUT_FILE = {
    ANCHOR: "pytorch_model.bin",
    ANCHOR_ST: "model.safetensors",
    SAFETENSORS: "model.safetensors",
    TORCH_SAVE: "model.pt",
}
#: Tied weights (the fixture's embed/head) make safetensors refuse zero_to_fp32's state dict.
NO_SAFETENSORS_ANCHOR = {FIXTURE}
BASE_DS = "baseline: import deepspeed's zero_to_fp32"
BASE_CKPTKIT = "baseline: import ckptkit + open"
BASE_CKPTKIT_TORCH = "baseline: import ckptkit, torch + open"
BASELINES = [BASE_DS, BASE_CKPTKIT, BASE_CKPTKIT_TORCH]


# -- DeepSpeed's interpreter -----------------------------------------------------------------


def ds_env() -> dict[str, str]:
    """Environment of DeepSpeed children: CPU accelerator (no CUDA probing), repo importable."""
    return child_env(DS_ACCELERATOR="cpu")


def ensure_deepspeed_python(explicit: str | None) -> str:
    """A python that imports deepspeed ``DEEPSPEED_VERSION``: ``explicit``, else the venv in
    ``benchmarks/out/dsvenv``, created on first use. That venv sees this interpreter's
    site-packages through a ``.pth`` file, so it reuses its torch instead of installing one."""
    if explicit:
        return explicit
    python = DS_VENV / "bin" / "python"
    if not _imports_deepspeed(python):
        progress(f"creating {DS_VENV} with deepspeed=={DEEPSPEED_VERSION} (once; a few minutes)")
        shutil.rmtree(DS_VENV, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(DS_VENV)], check=True)
        inner = subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        ours = sysconfig.get_paths(vars={"base": sys.prefix, "platbase": sys.prefix})["purelib"]
        Path(inner, "mainvenv.pth").write_text(ours + "\n")
        pip = [str(python), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, "wheel", "setuptools"], check=True)
        subprocess.run(
            [*pip, f"deepspeed=={DEEPSPEED_VERSION}", "--no-build-isolation"],
            check=True,
            env={**os.environ, "DS_BUILD_OPS": "0"},
        )
        if not _imports_deepspeed(python):
            raise SystemExit(f"{python} still cannot import deepspeed=={DEEPSPEED_VERSION}")
    return str(python)


def _imports_deepspeed(python: Path) -> bool:
    """Whether ``python`` exists and imports the expected deepspeed version."""
    if not python.exists():
        return False
    check = subprocess.run(
        [str(python), "-c", "import deepspeed; print(deepspeed.__version__)"],
        capture_output=True,
        text=True,
        env=ds_env(),
    )
    return check.returncode == 0 and check.stdout.strip().endswith(DEEPSPEED_VERSION)


# -- input -----------------------------------------------------------------------------------


def train_rank(stage: int, out: str, layers: int, width: int) -> None:
    """One torchrun rank (run by DeepSpeed's python): one Adam step of a stack of Linear layers
    under ZeRO ``stage``, then DeepSpeed's own ``save_checkpoint`` into ``out``."""
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    loss = engine(torch.randn(1, width)).square().mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(out, tag="global_step1")


def write_source(ds_python: str, stage: int, out: Path, layers: int, width: int) -> None:
    """Run :func:`train_rank` on ``WORLD_SIZE`` CPU ranks with torchrun under DeepSpeed's python
    (the first run on a machine also builds DeepSpeed's shm op, which takes minutes)."""
    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = [ds_python, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD_SIZE}"]
    argv += [f"--master_port={port}", str(Path(__file__).resolve()), "--train-rank"]
    argv += [str(stage), str(out), str(layers), str(width)]
    subprocess.run(argv, check=True, env=ds_env(), cwd=REPO_ROOT)


def ensure_source(case: str, ds_python: str, layers: int, width: int) -> Path:
    """The checkpoint run directory for ``case``, generated in a child process if missing."""
    if case == FIXTURE:
        return FIXTURE_DIR
    stage = GENERATED[case]
    params = {
        "stage": stage,
        "layers": layers,
        "width": width,
        "world_size": WORLD_SIZE,
        "deepspeed": DEEPSPEED_VERSION,
        "generator": GENERATOR_VERSION,
    }
    code = (
        "from bench_deepspeed import write_source\n"
        f"write_source({ds_python!r}, {stage}, out, {layers}, {width})"
    )
    return cached_input(
        OUT_DIR / f"deepspeed_{case}_{layers}x{width}",
        params,
        code,
        f"DeepSpeed ZeRO-{stage} save_checkpoint from {WORLD_SIZE} ranks",
    )


def source_mib(directory: Path) -> float:
    """Bytes of every file under the run directory, in MiB."""
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file()) / 2**20


def describe_source(directory: Path) -> dict[str, Any]:
    """Tensor count, fp32 model bytes and largest tensor of ``model.*``, as ckptkit lists them
    (in a child, so this process never imports ckptkit)."""
    code = f"""
        import ckptkit
        checkpoint = ckptkit.open({str(directory)!r})
        frame = checkpoint.tensors
        model = frame[frame["group"] == "model"]
        _report(format=checkpoint.catalog.format, tensors=len(model),
                model_mib=float(model["nbytes"].sum()) / 2**20,
                largest_mib=float(model["nbytes"].max()) / 2**20)
        """
    return run(python_argv(code)).report


# -- measurements ----------------------------------------------------------------------------

_TIMED = """
t0, c0 = time.perf_counter(), time.process_time()
{body}
t1, c1 = time.perf_counter(), time.process_time()
_report(op_s=t1 - t0, op_cpu_s=c1 - c0, torch_loaded=sys.modules.get("torch") is not None)
"""
_ZERO_TO_FP32 = (
    "from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict"
)


def _child(imports: str, body: str, python: str | None = None) -> list[str]:
    """A python child that imports first, then times ``body`` alone."""
    argv = python_argv(imports + "\n" + _TIMED.format(body=body))
    return argv if python is None else [python, *argv[1:]]


def tool_argv(tool: str, src: Path, dst: Path, ds_python: str) -> list[str]:
    """The command measuring ``tool`` on run directory ``src``, writing into ``dst``."""
    if tool in (ANCHOR, ANCHOR_ST):
        # max_shard_size=None: one file, like ckptkit (the 5GB default would need huggingface_hub)
        call = (
            f"convert_zero_checkpoint_to_fp32_state_dict({str(src)!r}, {str(dst)!r}, "
            f"max_shard_size=None, safe_serialization={tool == ANCHOR_ST})"
        )
        return _child(_ZERO_TO_FP32, call, ds_python)
    if tool == SAFETENSORS:
        return _child(
            "import ckptkit",
            f"ckptkit.unshard({str(src)!r}, {str(dst)!r}, groups=['model'], to='safetensors', "
            "progress=False)",
        )
    # to="torch" needs torch (it pickles torch's rebuild functions): imported before the clock
    # starts, as the deepspeed import brings it in before zero_to_fp32's clock starts
    return _child(
        "import ckptkit, torch",
        f"ckptkit.unshard({str(src)!r}, {str(dst)!r}, groups=['model'], to='torch', "
        "progress=False)",
    )


def baseline_argv(name: str, src: Path, ds_python: str) -> list[str]:
    """The interpreter state each tool starts from: its imports (and for ckptkit, ``open``)."""
    if name == BASE_DS:
        return _child(_ZERO_TO_FP32, "pass", ds_python)
    imports = "import ckptkit" if name == BASE_CKPTKIT else "import ckptkit, torch"
    return _child(imports, f"ckptkit.open({str(src)!r}).catalog")


def tools_for(case: str) -> list[str]:
    """The tools measured on ``case``: all, except DeepSpeed's safetensors output with ties."""
    return [t for t in TOOLS if not (t == ANCHOR_ST and case in NO_SAFETENSORS_ANCHOR)]


def output_dir(case: str, tool: str) -> Path:
    """Where ``tool`` writes for ``case`` (kept after the last round for the check)."""
    return WORK / f"{case}-{TOOLS.index(tool)}"


def remove(path: Path) -> None:
    """Delete a measured output and flush, so the next run starts with no writeback pending."""
    shutil.rmtree(path, ignore_errors=True)
    os.sync()


def jobs(sources: dict[str, Path], repeat: int, ds_python: str) -> dict[str, Callable[[], Run]]:
    """The child processes to measure, by name; each deletes its output after itself except on
    its last round, whose outputs :func:`verify` compares."""
    out: dict[str, Callable[[], Run]] = {}
    calls: dict[str, int] = {}
    largest = next(iter(sources.values()))
    for name in BASELINES:
        env = ds_env() if name == BASE_DS else None
        out[name] = lambda n=name, e=env: run(baseline_argv(n, largest, ds_python), env=e)
    for case, src in sources.items():
        for tool in tools_for(case):
            name = f"{case}: {tool}"

            def job(name=name, case=case, src=src, tool=tool) -> Run:
                calls[name] = calls.get(name, 0) + 1
                dst = output_dir(case, tool)
                remove(dst)
                dst.mkdir(parents=True)
                env = ds_env() if tool in (ANCHOR, ANCHOR_ST) else None
                result = run(tool_argv(tool, src, dst, ds_python), env=env)
                if calls[name] < repeat:
                    remove(dst)
                return result

            out[name] = job
    return out


def verify(case: str) -> dict[str, Any]:
    """Compare ckptkit's outputs of the last round with zero_to_fp32's, tensor by tensor, in a
    child: same keys (ckptkit's ``model`` group, relative to the group) and dtype, shape, bits."""
    tools = tools_for(case)
    paths = {tool: str(output_dir(case, tool) / OUTPUT_FILE[tool]) for tool in tools}
    code = f"""
        import torch
        from safetensors.torch import load_file
        paths = {paths!r}
        expected = torch.load(paths[{ANCHOR!r}], mmap=True, weights_only=True)
        outputs = {{
            tool: torch.load(path, mmap=True, weights_only=True) if path.endswith(".pt")
            else load_file(path)
            for tool, path in paths.items() if tool != {ANCHOR!r}
        }}
        def bits(t):
            t = t.contiguous()
            return t.view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)
        checked, bad, key_diffs = 0, [], {{}}
        for tool, got in outputs.items():
            if set(got) != set(expected):
                key_diffs[tool] = {{"missing": sorted(set(expected) - set(got))[:20],
                                    "extra": sorted(set(got) - set(expected))[:20]}}
            for key, want in expected.items():
                if key not in got:
                    continue
                have = got[key]
                if not (have.dtype == want.dtype and have.shape == want.shape
                        and torch.equal(bits(have), bits(want))):
                    bad.append(f"{{tool}}: {{key}}")
                checked += 1
        _report(checked=checked, bad=bad[:20], n_bad=len(bad), key_diffs=key_diffs,
                keys=len(expected))
        """
    result = run(python_argv(code)).report | {"compared": tools[1:]}
    for tool in tools:
        remove(output_dir(case, tool))
    return result


# -- report ----------------------------------------------------------------------------------


def summarize(runs: dict[str, list[Run]]) -> dict[str, dict[str, float]]:
    """Medians per measurement: timed step, whole process, CPU, peak RSS."""
    stats: dict[str, dict[str, float]] = {}
    for name, results in runs.items():
        stats[name] = {
            "op_s": median([r.report["op_s"] for r in results]),
            "process_wall_s": median([r.wall_s for r in results]),
            "op_cpu_s": median([r.report["op_cpu_s"] for r in results]),
            "process_cpu_s": median([r.cpu_s for r in results]),
            "peak_rss_mib": median([r.peak_rss_mib for r in results]),
            "torch_loaded": any(r.report["torch_loaded"] for r in results),
        }
    return stats


def baseline_for(tool: str, torch_loaded: bool) -> str:
    """The baseline row ``tool`` starts from (ckptkit runs that imported torch: with torch)."""
    if tool in (ANCHOR, ANCHOR_ST):
        return BASE_DS
    return BASE_CKPTKIT_TORCH if torch_loaded else BASE_CKPTKIT


def _row(name: str, s: dict[str, Any], anchor: dict[str, Any], over: float | None) -> list[str]:
    """One table row: timings, RSS and the ratios against the anchor."""
    return [
        name,
        f"{s['op_s']:.2f}",
        f"{s['process_wall_s']:.2f}",
        f"{s['op_cpu_s']:.2f}",
        f"{s['peak_rss_mib']:.0f}",
        "—" if over is None else f"{over:.0f}",
        ratio(s["op_s"], anchor["op_s"]),
        ratio(s["op_cpu_s"], anchor["op_cpu_s"]),
        ratio(s["process_wall_s"], anchor["process_wall_s"]),
    ]


def _goal_line(case: str, tool: str, s: dict[str, Any], anchor: dict, goal_rss: float) -> tuple:
    """Goal verdicts of one ckptkit row, and the line saying them."""
    goals = {
        "wall_vs_zero_to_fp32": {"value": s["op_s"] / anchor["op_s"], "goal": GOAL_VS_ANCHOR},
        "cpu_vs_zero_to_fp32": {
            "value": s["op_cpu_s"] / anchor["op_cpu_s"],
            "goal": GOAL_VS_ANCHOR,
        },
        "rss_over_baseline_mib": {"value": s["rss_over_baseline_mib"], "goal": goal_rss},
    }
    for item in goals.values():
        item["met"] = item["value"] <= item["goal"]
    said = {name: "MET" if item["met"] else "MISSED" for name, item in goals.items()}
    line = (
        f"- {case}, {tool}: wall / zero_to_fp32 {goals['wall_vs_zero_to_fp32']['value']:.3f}, "
        f"CPU / zero_to_fp32 {goals['cpu_vs_zero_to_fp32']['value']:.3f} (goal <= "
        f"{GOAL_VS_ANCHOR}: {said['wall_vs_zero_to_fp32']} / {said['cpu_vs_zero_to_fp32']}); "
        f"RSS over `{s['baseline'].removeprefix('baseline: ')}` "
        f"{s['rss_over_baseline_mib']:.0f} MiB (goal <= {goal_rss:.0f}: "
        f"{said['rss_over_baseline_mib']})"
    )
    return goals, line


def report(
    stats: dict[str, dict[str, Any]], info: dict[str, dict[str, Any]], repeat: int
) -> tuple[str, dict]:
    """The markdown table and the goal lines, plus goal verdicts per case and ckptkit target."""
    headers = [
        "measurement",
        "wall s",
        "process wall s",
        "CPU s",
        "peak RSS MiB",
        "RSS over baseline MiB",
        "wall / zero_to_fp32",
        "CPU / zero_to_fp32",
        "process wall / zero_to_fp32",
    ]
    rows = []
    for name in BASELINES:
        s = stats[name]
        rows.append(
            [name, "—", f"{s['process_wall_s']:.2f}", f"{s['process_cpu_s']:.2f}",
             f"{s['peak_rss_mib']:.0f}", "—", "—", "—", "—"]
        )  # fmt: skip
    goals: dict[str, Any] = {}
    lines = []
    for case in info:
        anchor = stats[f"{case}: {ANCHOR}"]
        goal_rss = info[case]["largest_mib"] + RSS_SLACK_MIB
        for tool in tools_for(case):
            s = stats[f"{case}: {tool}"]
            s["baseline"] = baseline_for(tool, bool(s["torch_loaded"]))
            s["rss_over_baseline_mib"] = s["peak_rss_mib"] - stats[s["baseline"]]["peak_rss_mib"]
            rows.append(_row(f"{case}: {tool}", s, anchor, s["rss_over_baseline_mib"]))
            if tool in (SAFETENSORS, TORCH_SAVE):
                goals[f"{case}: {tool}"], line = _goal_line(case, tool, s, anchor, goal_rss)
                lines.append(line)
        over, model_mib = anchor["rss_over_baseline_mib"], info[case]["model_mib"]
        times = f" = {over / model_mib:.2f} x the fp32 model" if model_mib >= 1 else ""
        lines.append(
            f"- {case}, zero_to_fp32: RSS over its baseline {over:.0f} MiB{times} "
            f"({model_mib:.1f} MiB)"
        )
    text = [
        f"Medians of {repeat} fresh processes each, run round-robin after reading every input",
        "file once (so the sources sit in the page cache; outputs are deleted after each run).",
        "`wall s` / `CPU s` time only the conversion inside the child (imports excluded: the",
        "deepspeed import brings torch, and ckptkit's to=torch child imports torch first too);",
        "`process wall s` includes interpreter start and imports (DeepSpeed's import is the",
        "heavy one). On a busy machine wall time mostly measures the wait for a CPU: the CPU",
        "ratios are the steadier reading. Peak RSS is the child's ru_maxrss; RSS over baseline",
        "subtracts the matching baseline row: `import ckptkit + open` (plus torch for ckptkit",
        "runs that imported torch), DeepSpeed's converter import for zero_to_fp32. Goal RSS =",
        f"largest model tensor + {RSS_SLACK_MIB} MiB; goal time = no slower than zero_to_fp32.",
        "",
        markdown_table(headers, rows),
        "",
        *lines,
    ]
    return "\n".join(text), goals


def warm_page_cache(directory: Path) -> None:
    """Read every file of ``directory`` once, so no measurement pays for the first disk read."""
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            with path.open("rb") as f:
                while f.read(8 << 20):
                    pass


def measure(sources: dict[str, Path], repeat: int, ds_python: str) -> tuple[dict, dict]:
    """Run every measurement round-robin and check the last round's outputs."""
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    try:
        for src in sources.values():
            warm_page_cache(src)
        runs = repeat_interleaved(jobs(sources, repeat, ds_python), repeat)
        checks = {}
        for case in sources:
            progress(f"verifying {case}: ckptkit outputs vs zero_to_fp32")
            checks[case] = verify(case)
            if checks[case]["n_bad"] or checks[case]["key_diffs"]:
                raise SystemExit(f"{case}: outputs differ from zero_to_fp32: {checks[case]}")
    finally:
        shutil.rmtree(WORK, ignore_errors=True)
    return runs, checks


def main() -> None:
    """Generate the inputs if needed, measure, verify, print the table and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement (median)")
    parser.add_argument("--layers", type=int, default=LAYERS, help="Linear layers in the model")
    parser.add_argument("--width", type=int, default=WIDTH, help="Linear(width, width)")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=CASES)
    parser.add_argument("--deepspeed-python", help=f"a python with deepspeed=={DEEPSPEED_VERSION}")
    parser.add_argument("--train-rank", nargs=4, help=argparse.SUPPRESS)  # torchrun's rank body
    args = parser.parse_args()
    if args.train_rank:
        stage, out, layers, width = args.train_rank
        train_rank(int(stage), out, int(layers), int(width))
        return

    env_before = environment()
    start = time.perf_counter()
    ds_python = ensure_deepspeed_python(args.deepspeed_python)
    sources = {case: ensure_source(case, ds_python, args.layers, args.width) for case in args.cases}
    info = {
        case: describe_source(path) | {"disk_mib": source_mib(path)}
        for case, path in sources.items()
    }
    runs, checks = measure(sources, args.repeat, ds_python)

    stats = summarize(runs)
    text, goals = report(stats, info, args.repeat)
    print(
        f"## bench_deepspeed: ckptkit unshard vs zero_to_fp32 (deepspeed {DEEPSPEED_VERSION}); "
        + "; ".join(
            f"{case}: {i['tensors']} model tensors, {i['model_mib']:.1f} MiB fp32, "
            f"{i['disk_mib']:.1f} MiB on disk"
            for case, i in info.items()
        )
        + "\n"
    )
    print(text)
    print(
        "\nChecked: "
        + "; ".join(
            f"{case}: {c['keys']} tensors x ({', '.join(c['compared'])}) bit-equal to {ANCHOR}"
            for case, c in checks.items()
        )
    )
    torch_free = {name: not s["torch_loaded"] for name, s in stats.items() if SAFETENSORS in name}
    print(f"to=safetensors ran without importing torch: {torch_free}")
    print(load_line(env_before))
    progress(f"total {time.perf_counter() - start:.0f} s")
    write_json(
        OUT_DIR / "bench_deepspeed.json",
        {
            "benchmark": "bench_deepspeed",
            "params": {
                "layers": args.layers,
                "width": args.width,
                "world_size": WORLD_SIZE,
                "deepspeed": DEEPSPEED_VERSION,
                "deepspeed_python": ds_python,
                "cases": info,
            },
            "repeat": args.repeat,
            "environment": {"before": env_before, "after_loadavg": list(os.getloadavg())},
            "medians": stats,
            "goals": goals,
            "checks": checks,
            "runs": runs_json(runs),
        },
    )
    progress(f"wrote {OUT_DIR / 'bench_deepspeed.json'}")


if __name__ == "__main__":
    main()
