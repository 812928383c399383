"""The README's demo output, generated from a recorded run of the demo config, never typed by hand.

    python -m tools.readme_demo --run        # run the demo in a fresh workdir, record it
    python -m tools.readme_demo --from-log LOG --workdir DIR --commit C   # a finished run
    python -m tools.readme_demo              # re-render README.md from the record
    python -m tools.readme_demo --check      # exit 1 if README.md differs from the record

`--run` runs `python -m gvpo_jax.main --config=configs/arith_tiny.py` (what `make demo` runs) and
times it. `--from-log` reads the stdout of such a run followed by a `/usr/bin/time -v` report.
Both write docs/demo/record.json (commit, wall and CPU seconds, the printed lines the README
shows) and copy the run's metrics.jsonl and curves.png next to it, then rewrite the text between
the demo markers of README.md. tests/test_readme.py checks that README, record and metrics agree.
"""

from __future__ import annotations

import argparse
import difflib
import json
import pathlib
import re
import resource
import shutil
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DEMO_DIR = ROOT / "docs" / "demo"
RECORD = DEMO_DIR / "record.json"
CONFIG = "configs/arith_tiny.py"
BEGIN, END = "<!-- demo:begin -->", "<!-- demo:end -->"
EVAL_RE = re.compile(
    r"\[eval\] step (\d+): accuracy avg@(\d+) \(T=[\d.]+\) ([\d.]+), greedy ([\d.]+)"
)


def pick_lines(stdout: str) -> dict:
    """The printed lines the README shows: every [eval] line (and the index of the first one
    after SFT), the last [sft] line, the first [rl] line, the final summary table and the eval_*
    lines of the summary."""
    lines = [line.rstrip() for line in stdout.splitlines()]
    sft = [i for i, line in enumerate(lines) if line.startswith("[sft] ")]
    evals = [i for i, line in enumerate(lines) if line.startswith("[eval] ")]
    rl = [line for line in lines if line.startswith("[rl] ")]
    start = next(i for i, line in enumerate(lines) if re.match(r"key\s+n\s+first", line))
    table = [lines[start]]
    for line in lines[start + 1 :]:
        if not re.match(r"[-\w/@]+\s", line) or line.startswith("eval_"):
            break
        table.append(line)
    return {
        "eval": [lines[i] for i in evals],
        "rl_eval_from": sum(i < sft[-1] for i in evals) if sft else 0,
        "sft_last": lines[sft[-1]] if sft else None,
        "rl_first": rl[0] if rl else None,
        "summary_table": table,
        "summary_eval": [line for line in lines if re.match(r"eval_\w+: ", line)],
    }


def git_commit() -> tuple[str, bool]:
    """The short commit of HEAD and whether tracked files differ from it."""
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout
    return git("rev-parse", "--short", "HEAD").strip(), bool(git("status", "--porcelain", "-uno"))


def run_demo(workdir: pathlib.Path) -> tuple[str, float, float, int]:
    """Runs the demo config, echoing its output; returns (stdout, wall s, CPU s, peak RSS KiB)."""
    if workdir.exists() and any(workdir.iterdir()):
        sys.exit(
            f"{workdir} is not empty; remove it or pass another --workdir (runs must be fresh)."
        )
    cmd = [sys.executable, "-m", "gvpo_jax.main", f"--config={CONFIG}", f"--workdir={workdir}"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    out = []
    for line in proc.stdout:
        print(line, end="", flush=True)
        out.append(line)
    if proc.wait():
        sys.exit(f"the demo run failed with status {proc.returncode}")
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return "".join(out), wall, cpu, after.ru_maxrss


def read_log(log: pathlib.Path) -> tuple[str, float, float, int]:
    """A finished run's stdout followed by `/usr/bin/time -v`: (stdout, wall s, CPU s, RSS KiB)."""
    text = log.read_text()
    if text.rstrip().splitlines()[-1].strip() != "done":
        sys.exit(f"{log} does not end with a 'done' line: the run has not finished")
    field = lambda name: re.search(rf"{re.escape(name)}.*?: (\S+)$", text, re.M).group(1)
    *hours_minutes, seconds = field("Elapsed (wall clock) time").split(":")
    wall = float(seconds) + sum(int(x) * 60**i for i, x in enumerate(reversed(hours_minutes), 1))
    cpu = float(field("User time")) + float(field("System time"))
    rss = int(field("Maximum resident set size"))
    return text.split("\tCommand being timed:")[0], wall, cpu, rss


def save_record(stdout, wall, cpu, rss, *, commit, dirty, workdir: pathlib.Path) -> dict:
    """Writes docs/demo/record.json and copies the run's metrics.jsonl and curves.png there."""
    DEMO_DIR.mkdir(parents=True, exist_ok=True)
    record = {
        "commit": commit,
        "dirty": dirty,
        "command": f"python -m gvpo_jax.main --config={CONFIG}",
        "seed": int(re.search(r"c\.seed = (\d+)", (ROOT / CONFIG).read_text()).group(1)),
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "max_rss_kib": rss,
        "lines": pick_lines(stdout),
    }
    RECORD.write_text(json.dumps(record, indent=1) + "\n")
    for name in ("metrics.jsonl", "curves.png"):
        shutil.copyfile(workdir / name, DEMO_DIR / name)
    return record


def render(record: dict) -> str:
    """The README block: where and how fast it ran, then the printed lines with `...` where
    lines were left out."""
    lines = record["lines"]
    minutes, seconds = divmod(round(record["wall_s"]), 60)
    commit = f"`{record['commit']}`" + (" with uncommitted changes" if record["dirty"] else "")
    cut = lines["rl_eval_from"]
    before, rl_evals = lines["eval"][:cut], lines["eval"][cut:]
    matches = [EVAL_RE.match(line) for line in rl_evals]
    body = [*before, lines["sft_last"], rl_evals[0], lines["rl_first"], "..."]
    body += [rl_evals[len(rl_evals) // 2], "...", rl_evals[-1]]
    body += [*lines["summary_table"], *lines["summary_eval"]]
    return "\n".join(
        [
            f"Measured at {commit}: {minutes} min {seconds} s wall, {round(record['cpu_s'])} s CPU "
            f"on a 2-core CPU, seed {record['seed']}.",
            f"Held-out avg@{matches[0].group(2)} at each evaluation of the RL phase: "
            f"{' / '.join(m.group(3) for m in matches)}.",
            "",
            "```",
            *[line for line in body if line is not None],
            "```",
        ]
    )


def split_readme(text: str) -> tuple[str, str, str]:
    """README.md as (text up to the begin marker, the block between the markers, the rest)."""
    head, rest = text.split(BEGIN, 1)
    block, tail = rest.split(END, 1)
    return head, block.strip("\n"), tail


def main(argv=None) -> int:
    """Records a run (--run / --from-log) if asked, then checks or rewrites README.md's block."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", action="store_true", help="run the demo config and record it")
    p.add_argument("--from-log", type=pathlib.Path, help="record a finished run from its log")
    p.add_argument("--workdir", type=pathlib.Path, help="the run's workdir (--run: a fresh one)")
    p.add_argument("--commit", help="with --from-log: the commit the run was made at")
    p.add_argument("--dirty", action="store_true", help="with --from-log: the tree had changes")
    p.add_argument("--check", action="store_true", help="exit 1 if README.md differs")
    args = p.parse_args(argv)
    if args.run:
        workdir = (args.workdir or ROOT / "runs" / "readme_demo").resolve()
        commit, dirty = git_commit()
        save_record(*run_demo(workdir), commit=commit, dirty=dirty, workdir=workdir)
    elif args.from_log:
        if not (args.commit and args.workdir):
            p.error("--from-log needs --workdir and --commit")
        result = read_log(args.from_log)
        save_record(*result, commit=args.commit, dirty=args.dirty, workdir=args.workdir)
    head, old, tail = split_readme(README.read_text())
    new = render(json.loads(RECORD.read_text()))
    if args.check:
        if old != new:
            diff = difflib.unified_diff(
                old.splitlines(), new.splitlines(), "README.md", "record", lineterm=""
            )
            print("\n".join(diff))
        return int(old != new)
    README.write_text(f"{head}{BEGIN}\n{new}\n{END}{tail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
