#!/usr/bin/python3
# tools/plots.py's test, headless: every picture is made here, from inputs written here (in the
# formats ./train and ./plan write) and from short ./train runs, and what each picture draws
# (plots.py --data: its lines, bars, spans, texts and image cells, read back from the figure)
# is compared with values worked out in this file: by hand from the inputs, from the book's
# 1F1B chart, from the ZeRO-1 formula, or from the loss lines ./train printed.
# Part of `make test` (tools/run_tests.sh), which skips it without Debian's python3-matplotlib
# (`make deps-plots` installs it). About half a minute on two cores.
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLOTS = [sys.executable, os.path.join(ROOT, "tools", "plots.py")]
MIB = 2.0**20
passed = failed = 0


def check(name, ok, detail=""):
    global passed, failed
    if ok:
        passed += 1
        print(f"ok: {name}")
    else:
        failed += 1
        print(f"FAILED: {name}: {detail}")


def close(a, b, tol):
    return a is not None and b is not None and abs(a - b) <= tol


def same(xs, ys, tol):
    return len(xs) == len(ys) and all(close(a, b, tol) for a, b in zip(xs, ys))


def plot(d, name, *args):
    """Runs plots.py; returns the data of its picture (None, with a FAILED line, if it failed)."""
    png, data = os.path.join(d, name + ".png"), os.path.join(d, name + ".json")
    r = subprocess.run(PLOTS + list(args) + ["-o", png, "--data", data], capture_output=True,
                       text=True)
    if r.returncode != 0 or not os.path.exists(data):
        check(f"{name}: plots.py ran", False, r.stdout + r.stderr)
        return None
    with open(png, "rb") as f:
        check(f"{name}: a PNG was written", f.read(8) == b"\x89PNG\r\n\x1a\n")
    with open(data) as f:
        return json.load(f)["axes"]


def refuses(name, *args, says=""):
    """Bad input ends as ./train's does: exit code 2, one "error:" line, no traceback."""
    try:
        r = subprocess.run(PLOTS + list(args), capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        check(name, False, "still running after 60 s (a read that never ends?)")
        return
    check(name, r.returncode == 2 and "error:" in r.stderr and "Traceback" not in r.stderr
          and says in r.stderr, f"exit code {r.returncode}: {r.stdout + r.stderr}")


def spans_by_rank(axes):
    out = {}
    for s in axes[0]["spans"]:
        rank, op = re.match(r"rank (\d+) (\w+)", s["row"]).groups()
        out.setdefault(int(rank), []).append((op, s["start"], s["width"]))
    return {r: sorted(v, key=lambda o: o[1]) for r, v in out.items()}


def same_spans(got, want, tol):
    return sorted(got) == sorted(want) and all(
        len(got[r]) == len(want[r]) and
        all(g[0] == w[0] and close(g[1], w[1], tol) and close(g[2], w[2], tol)
            for g, w in zip(got[r], want[r])) for r in want)


# The book's 1F1B on 2 stages and 4 micro-batches, in ticks (a forward 1, a backward 2), as
# Playbook §8 draws it: stage 0 runs one forward ahead, then alternates.
BOOK_1F1B_2x4 = {
    0: [("F1", 0, 1), ("F2", 1, 1), ("B1", 4, 2), ("F3", 6, 1), ("B2", 7, 2), ("F4", 9, 1),
        ("B3", 10, 2), ("B4", 13, 2)],
    1: [("F1", 1, 1), ("B1", 2, 2), ("F2", 4, 1), ("B2", 5, 2), ("F3", 7, 1), ("B3", 8, 2),
        ("F4", 10, 1), ("B4", 11, 2)],
}


def synthetic(d):
    # Two --log-json files: the second 0.25 above the first at step 3, with validation at 2, 4.
    with open(os.path.join(d, "a.jsonl"), "w") as f:
        for s, loss in enumerate([9.5, 8.5, 7.5, 6.5], 1):
            f.write(json.dumps({"step": s, "loss": loss, "lr": 1e-3, "grad_norm": 1.0}) + "\n")
    with open(os.path.join(d, "b.jsonl"), "w") as f:
        for s, loss in enumerate([9.5, 8.5, 7.75, 6.5], 1):
            row = {"step": s, "loss": loss, "lr": 1e-3, "grad_norm": 1.0}
            if s % 2 == 0:
                row["val_loss"] = 11.0 - s
            f.write(json.dumps(row) + "\n")
    ax = plot(d, "loss", "loss", f"{d}/a.jsonl", f"{d}/b.jsonl", "--labels", "dp 2", "tp 2")
    if ax:
        lines = {ln["label"]: ln for ln in ax[0]["lines"]}
        check("loss: run 1's line is its losses", "dp 2" in lines and
              lines["dp 2"]["x"] == [1, 2, 3, 4] and lines["dp 2"]["y"] == [9.5, 8.5, 7.5, 6.5])
        check("loss: run 2's line is its losses", "tp 2" in lines and
              lines["tp 2"]["y"] == [9.5, 8.5, 7.75, 6.5])
        val = lines.get("validation loss", {})
        check("loss: validation points at steps 2 and 4",
              val.get("x") == [2, 4] and val.get("y") == [9.0, 7.0], str(val))
        texts = [t["text"] for t in ax[0]["texts"]]
        check("loss: the largest gap written is 0.25",
              "largest gap from dp 2: 0.25" in texts, str(texts))

    # A --trace of 2 ranks, one step of 1F1B on 2 micro-batches (microseconds).
    ops = {0: [("F0", 0, 10), ("F1", 10, 10), ("B0", 40, 20), ("B1", 70, 20)],
           1: [("F0", 10, 10), ("B0", 20, 20), ("F1", 40, 10), ("B1", 50, 20)]}
    events = [{"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}}
              for r in ops]
    for r, mine in ops.items():
        events += [{"name": n, "ph": "X", "pid": r, "tid": 0, "ts": ts, "dur": dur}
                   for n, ts, dur in mine]
        events.append({"name": f"step 1 ({3 - r} host syncs)", "ph": "X", "pid": r, "tid": 0,
                       "ts": 0, "dur": 95})
    events.append({"name": "send_recv", "ph": "X", "pid": 1, "tid": 1, "ts": 20, "dur": 1})
    with open(os.path.join(d, "trace.json"), "w") as f:
        json.dump({"displayTimeUnit": "ms", "traceEvents": events}, f)
    ax = plot(d, "schedule", "schedule", f"{d}/trace.json")
    if ax:
        # Measured: the spans in ms from the step's start, micro-batches numbered from 1.
        want = {r: [(n[0] + str(int(n[1:]) + 1), ts / 1e3, dur / 1e3) for n, ts, dur in mine]
                for r, mine in ops.items()}
        check("schedule: every span where the trace put it", same_spans(spans_by_rank(ax), want,
              1e-9), str(spans_by_rank(ax)))
    ax = plot(d, "ticks", "schedule", f"{d}/trace.json", "--ticks", "--step", "1")
    if ax:
        want = {0: [("F1", 0, 1), ("F2", 1, 1), ("B1", 4, 2), ("B2", 7, 2)],
                1: [("F1", 1, 1), ("B1", 2, 2), ("F2", 4, 1), ("B2", 5, 2)]}
        check("schedule --ticks: the book's 1F1B on 2 stages, 2 micro-batches",
              same_spans(spans_by_rank(ax), want, 0), str(spans_by_rank(ax)))

    # --report memory and comm as ./train prints them: 2 ranks, ZeRO-1, Ψ = 1000, Ψ' = 1004.
    report = """\
memory per rank (--report memory), ZeRO-1 over dp_cp, N = 2: bytes now; fp32, so 4 per weight
  Ψ = 1000 parameters; each unit (embedding, block, head) splits into N equal shards: Ψ' = N x 502 = 1004, 4 of them padding
  rank            params        grads    optimizer       static   peak activations, workspace
  0                 4016         4016         4016        12048   10.00 KiB, 2.00 KiB
  1                 4016         4016         4016        12048   10.00 KiB, 2.00 KiB
  book              4000         4000         4000        12000   Playbook §4.1: 4Ψ + 4Ψ + 8Ψ/N
  + padding           16           16           16           48   the formula at Ψ' - Ψ
  = padded          4016         4016         4016        12048   the formula at Ψ', what every rank should hold
activations per block and micro-batch (--report memory; tp 1, recompute none, flash attention, stored in fp32):
  measured 5.00 KiB (5120 B), formula 4.00 KiB (4096 B), 1.25x
communication per step (--report comm; averaged over 2 steps, validation and checkpoints included):
  group    N  collective           calls       elements  bytes (formula)    min..max, ranks
  dp_cp    2  all_reduce             1.0         1004.0          3.92 KiB 3.92 KiB..3.92 KiB
ZeRO-1 traffic per training step over dp_cp (N = 2; averaged over 2 steps; validation and checkpoint gathers excluded):
  collective           calls          bytes     expected          bytes
  reduce_scatter         1.0           2008            1           2008
  all_gather             1.0           2000            1           2008
  total                                4008                        4016
"""
    with open(os.path.join(d, "report.txt"), "w") as f:
        f.write(report)
    ax = plot(d, "memory", "memory", f"{d}/report.txt")
    if ax:
        bars = {b["label"].split(",")[0]: b["height"] for b in ax[0]["bars"]}
        check("memory: rank 0's bars are its row and the measured activations",
              same(bars.get("measured", []), [4016 / MIB] * 3 + [5120 / MIB], 1e-12), str(bars))
        check("memory: the formula's bars are the padded row and the activation formula",
              same(bars.get("formula", []), [4016 / MIB] * 3 + [4096 / MIB], 1e-12), str(bars))
        texts = [t["text"] for t in ax[0]["texts"]]
        check("memory: each pair's ratio written", texts == ["ratio 1.000"] * 3 + ["ratio 1.250"],
              str(texts))
    ax = plot(d, "comm", "comm", f"{d}/report.txt")
    if ax:
        labels = ax[0]["yticklabels"]
        bars = {b["label"].split(" ")[0]: b["width"] for b in ax[0]["bars"]}
        check("comm: one row per collective", labels == [
            "dp_cp all_reduce, every call", "ZeRO reduce_scatter, training",
            "ZeRO all_gather, training"], str(labels))
        check("comm: measured bytes", same(bars.get("measured", []),
              [3.92 * 1024 / MIB, 2008 / MIB, 2000 / MIB], 1e-12), str(bars))
        check("comm: formula bytes (none for a row without one)", same(
            bars.get("the", []), [0, 2008 / MIB, 2008 / MIB], 1e-12), str(bars))

    # ./plan --campaign --json: two models, two node counts, one cell where nothing fits.
    best = {"dp": 4, "tp": 1, "sp": False, "pp": 2, "zero": 1, "mbs": 4, "grad_acc": 16,
            "mfu": 0.44, "memory_gb": 40}
    cells = [{"model": "1B", "nodes": 1, "best": best, "book": {"mfu": 0.443}},
             {"model": "1B", "nodes": 2, "best": dict(best, dp=8, tp=2, sp=True, pp=1, zero=0,
                                                      mfu=0.41), "book": None},
             {"model": "70B", "nodes": 1, "best": None, "book": None},
             {"model": "70B", "nodes": 2, "best": dict(best, dp=2, tp=8, sp=True, pp=1,
                                                       mfu=0.30), "book": None}]
    with open(os.path.join(d, "campaign.json"), "w") as f:
        json.dump(cells, f)
    ax = plot(d, "heatmap", "heatmap", f"{d}/campaign.json")
    if ax:
        image = ax[0]["images"][0] if ax[0]["images"] else []
        check("heatmap: cells coloured by MFU in %, empty where nothing fits",
              len(image) == 2 and same(image[0], [44.0, 41.0], 1e-9) and image[1][0] is None
              and close(image[1][1], 30.0, 1e-9), str(image))
        texts = {(round(t["x"]), round(t["y"])): t["text"] for t in ax[0]["texts"]}
        check("heatmap: each cell names its layout",
              texts.get((0, 0)) == "dp4 tp1 pp2\nz1 mbs4 ga16\n44.0% (book 44.3%)" and
              texts.get((1, 0)) == "dp8 tp2+sp pp1\nz0 mbs4 ga16\n41.0%" and
              texts.get((0, 1)) == "nothing fits", str(texts))
        check("heatmap: models down, nodes across",
              ax[0]["yticklabels"] == ["1B", "70B"] and ax[0]["xticklabels"] == ["1", "2"])

    refuses("loss refuses a trace", "loss", f"{d}/trace.json", "-o", f"{d}/x.png")
    refuses("schedule refuses a campaign", "schedule", f"{d}/campaign.json", "-o", f"{d}/x.png")
    refuses("memory refuses a log", "memory", f"{d}/a.jsonl", "-o", f"{d}/x.png")
    refuses("heatmap refuses a trace", "heatmap", f"{d}/trace.json", "-o", f"{d}/x.png")
    refuses("schedule refuses a step it lacks", "schedule", f"{d}/trace.json", "--step", "2",
            "-o", f"{d}/x.png")
    refuses("a missing file", "loss", f"{d}/none.jsonl", "-o", f"{d}/x.png")
    refuses("a directory as -o", "loss", f"{d}/a.jsonl", "-o", d)
    # Inputs that are not what the subcommand reads, and outputs over inputs.
    with open(f"{d}/not_json.json", "w") as f:
        f.write("step 1 | loss 2.5\n")
    refuses("a trace that is not JSON", "schedule", f"{d}/not_json.json", "-o", f"{d}/x.png",
            says="not JSON")
    refuses("a campaign that is not JSON", "heatmap", f"{d}/not_json.json", "-o", f"{d}/x.png",
            says="not JSON")
    with open(f"{d}/events.json", "w") as f:
        json.dump({"traceEvents": [{"ph": "X"}]}, f)
    refuses("a trace whose spans have no names", "schedule", f"{d}/events.json", "-o",
            f"{d}/x.png")
    log = open(f"{d}/a.jsonl").read()
    refuses("-o over its input", "loss", f"{d}/a.jsonl", "-o", f"{d}/a.jsonl",
            says="would overwrite")
    os.symlink(f"{d}/a.jsonl", f"{d}/a_link.png")
    refuses("-o over its input through a symlink", "loss", f"{d}/a.jsonl", "-o",
            f"{d}/a_link.png", says="would overwrite")
    refuses("--data over its input", "loss", f"{d}/a.jsonl", "-o", f"{d}/y.png", "--data",
            f"{d}/a.jsonl", says="would overwrite")
    check("the log is untouched", open(f"{d}/a.jsonl").read() == log)
    os.mkfifo(f"{d}/fifo.jsonl")  # nothing ever writes it: a read would wait forever
    refuses("a FIFO as input", "loss", f"{d}/fifo.jsonl", "-o", f"{d}/x.png",
            says="not a regular file")


def train(d, name, ranks, *flags):
    """Runs ./train (under mpirun for ranks > 1); returns its output, or None if it failed."""
    cmd = [os.path.join(ROOT, "train"), "--device", "cpu", "--model", "tiny", "--seq", "32",
           "--val-every", "0", *flags]
    if ranks > 1:
        extra = ["--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
        cmd = ["mpirun", "-np", str(ranks), *extra] + cmd
    env = dict(os.environ, OMPI_MCA_btl_vader_single_copy_mechanism="none",
               OPENBLAS_NUM_THREADS="1")
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=d, env=env, timeout=300)
    if r.returncode != 0:
        check(f"{name}: ./train ran", False, r.stdout[-2000:] + r.stderr[-2000:])
        return None
    return r.stdout


def from_runs(d):
    # A run's --log-json: the line drawn is the loss ./train printed at every step (4 decimals).
    out = train(d, "loss of a run", 1, "--steps", "5", "--log-json", f"{d}/run.jsonl")
    ax = out and plot(d, "run_loss", "loss", f"{d}/run.jsonl")
    if ax:
        printed = [float(x) for x in re.findall(r"^step +\d+/5 \| loss ([\d.]+)", out, re.M)]
        line = ax[0]["lines"][0]
        check("loss of a run: the line is the loss printed at each step",
              line["x"] == [1, 2, 3, 4, 5] and same(line["y"], printed, 5e-5), f"{line} {printed}")
    # A --trace of 1F1B on 2 stages and 4 micro-batches, re-timed: the book's chart.
    out = train(d, "schedule of a run", 2, "--pp", "2", "--pp-schedule", "1f1b", "--grad-acc",
                "4", "--steps", "1", "--trace", f"{d}/run_trace.json")
    ax = out is not None and plot(d, "run_ticks", "schedule", f"{d}/run_trace.json", "--ticks")
    if ax:
        check("schedule of a run, --ticks: the book's 1F1B on 2 stages, 4 micro-batches",
              same_spans(spans_by_rank(ax), BOOK_1F1B_2x4, 0), str(spans_by_rank(ax)))
    # --report memory of ZeRO-1 on 2 ranks: the formula's bars are 4Ψ', 4Ψ' and 8Ψ'/N at the
    # padded count the report states, and rank 0 holds exactly those bytes.
    out = train(d, "memory of a run", 2, "--dp", "2", "--zero", "1", "--steps", "1",
                "--report", "memory")
    if out is not None:
        with open(os.path.join(d, "run_report.txt"), "w") as f:
            f.write(out)
        m = re.search(r"Ψ' = N x \d+ = (\d+)", out)
        ax = m and plot(d, "run_memory", "memory", f"{d}/run_report.txt")
        if ax:
            padded = int(m.group(1))
            want = [4 * padded / MIB, 4 * padded / MIB, 8 * padded / 2 / MIB]
            bars = {b["label"].split(",")[0]: b["height"][:3] for b in ax[0]["bars"]}
            check("memory of a run: formula bars 4Ψ', 4Ψ', 8Ψ'/2",
                  same(bars.get("formula", []), want, 1e-12), f"{bars} {want}")
            check("memory of a run: rank 0 holds the formula's bytes",
                  same(bars.get("measured", []), want, 1e-12), f"{bars} {want}")
        else:
            check("memory of a run: the report states Ψ'", False, out[-2000:])


with tempfile.TemporaryDirectory() as d:
    synthetic(d)
    if os.path.exists(os.path.join(ROOT, "train")):
        from_runs(d)
    else:
        print("SKIP: the runs' pictures (no ./train: make train first)")
print(f"{passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
