#!/usr/bin/python3
# plots.py: pictures of what ./train and ./plan write, for `make plots` (Debian's
# python3-matplotlib; no network). Each subcommand reads one kind of output and writes a PNG:
#   loss LOG.jsonl [LOG.jsonl ...] -o loss.png [--labels a b ...]   --log-json files, overlaid
#   schedule TRACE.json -o schedule.png [--step N] [--ticks]         a --trace file's pipeline
#   memory REPORT.txt -o memory.png                                  --report memory, as text
#   comm REPORT.txt -o comm.png                                      --report comm, as text
#   heatmap CAMPAIGN.json -o heatmap.png                             ./plan --campaign --json
# With --data FILE.json each also writes what its picture draws, read back from the figure's
# artists (lines, bars, spans, texts, image cells): tests/test_plots.py checks those numbers.
# The reports exist only as text: save rank 0's output, as make_plots.sh does, of
#   mpirun -np 4 ./train --dp 2 --tp 2 --zero 1 --mbs 2 --seq 64 --steps 2 --report memory,comm
# and give the file to memory and comm.
import argparse
import json
import os
import re
import stat
import sys

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.container import BarContainer  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402


def fail(message):
    """Bad input, as ./train and ./plan end on it: one line on stderr and exit code 2."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def read_json(path, what):
    """A whole JSON file, or one line and exit code 2 naming it and what wrote it."""
    with open(path) as f:
        try:
            return json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            fail(f"{path}: not JSON ({e}); give the file {what} wrote")


# ----------------------------------------------------------------------------
# Loss curves: one line per --log-json file, validation points where the run evaluated.


def read_jsonl(path):
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                fail(f"{path}:{n}: not a JSON line ({e}); "
                         "give the file --log-json wrote")
    return rows


def plot_loss(args):
    labels = args.labels or [os.path.splitext(os.path.basename(p))[0] for p in args.logs]
    if len(labels) != len(args.logs):
        fail(f"--labels names {len(labels)} runs for {len(args.logs)} files")
    fig, ax = plt.subplots(figsize=(8, 4.5))
    styles = ["-", "--", ":", "-."]
    first, gap, val_named = None, 0.0, False
    for i, (path, label) in enumerate(zip(args.logs, labels)):
        rows = [r for r in read_jsonl(path)
                if isinstance(r, dict) and "step" in r and "loss" in r]
        if not rows:
            fail(f"{path}: no line with step and loss; give the file --log-json wrote")
        # Layouts that agree draw on top of each other: vary the dash so each stays visible.
        line, = ax.plot([r["step"] for r in rows], [r["loss"] for r in rows],
                        styles[i % len(styles)], lw=1.5, label=label)
        val = [r for r in rows if "val_loss" in r]
        if val:
            ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o",
                    color=line.get_color(), ms=6, mfc="none",
                    label=None if val_named else "validation loss")
            val_named = True
        losses = {r["step"]: r["loss"] for r in rows}
        if first is None:
            first = losses
        else:
            gap = max([gap] + [abs(v - first[s]) for s, v in losses.items() if s in first])
    if len(args.logs) > 1:
        ax.text(0.02, 0.03, f"largest gap from {labels[0]}: {gap:.2g}", transform=ax.transAxes,
                fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title(args.title or "Training loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, args)


# ----------------------------------------------------------------------------
# Pipeline schedule: the compute spans of one step on every rank, as the book draws 1F1B.

KIND_COLOR = {"F": "#4c8bd6", "B": "#6cc070", "W": "#f2c14e"}


def read_schedule(path, step):
    """Each rank's operations in one step: [(kind, micro, chunk, start ms, length ms)]."""
    trace = read_json(path, "./train --trace")
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    spans = [e for e in events if e.get("ph") == "X" and e.get("tid", 0) == 0]
    # "step N (...)" spans bound each step on each rank; F3, B3, W3 (with " chunk c" when
    # interleaved) are the schedule's operations within it.
    step_re, op_re = re.compile(r"step (\d+)"), re.compile(r"([FBW])(\d+)(?: chunk (\d+))?$")
    steps = sorted({int(m.group(1)) for e in spans if (m := step_re.match(e["name"]))})
    if not steps:
        fail(f"{path}: no step spans; give the file ./train --trace wrote")
    step = step or steps[-1]
    if step not in steps:
        fail(f"--step {step}: the trace holds steps {steps[0]}..{steps[-1]}")
    bounds = {e["pid"]: (e["ts"], e["ts"] + e["dur"]) for e in spans
              if (m := step_re.match(e["name"])) and int(m.group(1)) == step}
    t0 = min(b[0] for b in bounds.values())
    ops = {}
    for rank, (lo, hi) in sorted(bounds.items()):
        mine = []
        for e in sorted(spans, key=lambda e: e["ts"]):
            m = op_re.match(e["name"])
            if e["pid"] == rank and m and lo <= e["ts"] <= hi:
                mine.append((m.group(1), int(m.group(2)), int(m.group(3) or 0),
                             (e["ts"] - t0) / 1e3, e["dur"] / 1e3))
        ops[rank] = mine
    if not any(ops.values()):
        fail(f"{path}: step {step} has no F/B/W spans (a run without --pp?)")
    return step, ops


def in_ticks(ops):
    """The same operations re-timed as the book draws them: F one tick, B two (one with a
    separate W), each as soon as its rank is free and its input has arrived. Rank r is taken
    as pipeline stage r: a trace of a run with --pp only."""
    p = len(ops)
    chunks = 1 + max(op[2] for mine in ops.values() for op in mine)
    split_w = any(op[0] == "W" for mine in ops.values() for op in mine)
    length = {"F": 1, "B": 1 if split_w else 2, "W": 1}
    stage = {rank: s for s, rank in enumerate(sorted(ops))}
    done, placed, free = {}, {r: [] for r in ops}, {r: 0 for r in ops}
    next_op = {r: 0 for r in ops}

    def needs(kind, micro, chunk, s):  # the operation whose output this one waits for
        if kind == "F" and s > 0:
            return ("F", micro, chunk, s - 1)
        if kind == "F" and chunk > 0:
            return ("F", micro, chunk - 1, p - 1)
        if kind == "B" and s < p - 1:
            return ("B", micro, chunk, s + 1)
        if kind == "B" and chunk < chunks - 1:
            return ("B", micro, chunk + 1, 0)
        return None

    progress = True
    while progress:
        progress = False
        for r in ops:
            while next_op[r] < len(ops[r]):
                kind, micro, chunk, _, _ = ops[r][next_op[r]]
                need = needs(kind, micro, chunk, stage[r])
                if need is not None and need not in done:
                    break
                start = max(free[r], done.get(need, 0))
                free[r] = done[(kind, micro, chunk, stage[r])] = start + length[kind]
                placed[r].append((kind, micro, chunk, start, length[kind]))
                next_op[r] += 1
                progress = True
    if any(next_op[r] < len(ops[r]) for r in ops):
        fail("--ticks: the ranks' operations do not form one pipeline "
                 "(a trace of a run with --dp, --tp or --cp as well as --pp?)")
    return placed


def plot_schedule(args):
    step, ops = read_schedule(args.trace, args.step)
    if args.ticks:
        ops = in_ticks(ops)
    ranks = sorted(ops)
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(ranks) + 1.6))
    for row, rank in enumerate(ranks):
        for kind, micro, chunk, start, width in ops[rank]:
            ax.broken_barh([(start, width)], (row - 0.4, 0.8), facecolor=KIND_COLOR[kind],
                           edgecolor="black", lw=0.5, hatch="//" if chunk % 2 else None,
                           label=f"_span rank {rank} {kind}{micro + 1}")
            # The book numbers micro-batches from 1.
            ax.text(start + width / 2, row, str(micro + 1), ha="center", va="center",
                    fontsize=7, clip_on=True)
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.invert_yaxis()  # the first stage on top, as the book draws it
    ax.set_xlabel("ticks (a forward takes one)" if args.ticks
                  else "ms since the step began (measured)")
    kinds = {op[0] for mine in ops.values() for op in mine}
    handles = [Patch(facecolor=c, edgecolor="black", label=k)
               for k, c in KIND_COLOR.items() if k in kinds]
    if any(op[2] % 2 for mine in ops.values() for op in mine):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="odd chunk"))
    fig.legend(handles=handles, loc="lower center", fontsize=8, ncol=len(handles), frameon=False)
    ax.set_title(args.title or f"Pipeline schedule, step {step} (numbers: micro-batch)")
    ax.grid(axis="x", alpha=0.3)
    save(fig, args, bottom=0.35 / fig.get_figheight())


# ----------------------------------------------------------------------------
# The reports, parsed from ./train's text (runtime/report.cu prints them).

UNITS = {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4}


def human(text):  # "1.25 MiB" -> bytes
    number, unit = text.split()
    return float(number) * UNITS[unit]


def read_text(path):
    with open(path) as f:
        return f.read().splitlines()


def parse_memory(lines):
    """Static bytes per rank and the formula's; activations per block measured and formula."""
    ranks, formula, act = [], None, None
    for line in lines:
        if m := re.match(r"\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+\S", line):
            ranks.append([float(m.group(i)) for i in (2, 3, 4)])
        elif m := re.match(r"\s+(book|= padded)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s", line):
            formula = [float(m.group(i)) for i in (2, 3, 4)]  # "= padded" comes last: it wins
        elif m := re.match(r"\s+measured .*\((\d+) B\), formula .*\((\d+) B\)", line):
            act = (float(m.group(1)), float(m.group(2)))
    return ranks, formula, act


def plot_memory(args):
    ranks, formula, act = parse_memory(read_text(args.report))
    if not ranks or formula is None:
        fail(f"{args.report}: no memory table; save the output of "
                 "./train ... --report memory to the file")
    cats = ["params", "grads", "optimizer"]
    measured = [ranks[0][i] for i in range(3)]
    lo = [min(r[i] for r in ranks) for i in range(3)]
    hi = [max(r[i] for r in ranks) for i in range(3)]
    book = list(formula)
    if act:
        cats.append("activations\nper block")
        measured.append(act[0]), lo.append(act[0]), hi.append(act[0]), book.append(act[1])
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = range(len(cats))
    mib = [v / 2**20 for v in measured]
    err = [[(m - a) / 2**20 for m, a in zip(measured, lo)],
           [(b - m) / 2**20 for m, b in zip(measured, hi)]]
    ax.bar([i - 0.2 for i in x], mib, 0.4, yerr=err, capsize=3,
           label=f"measured, rank 0 (bars: min..max of {len(ranks)} ranks)", color="#4c8bd6")
    ax.bar([i + 0.2 for i in x], [v / 2**20 for v in book], 0.4, label="formula",
           color="#cccccc", edgecolor="black", hatch="//")
    for i, (m, b) in enumerate(zip(measured, book)):
        ax.text(i, max(m, b) / 2**20, f"ratio {m / b:.3f}" if b else "",
                ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x))
    ax.set_xticklabels(cats)
    ax.set_ylabel("MiB per rank")
    ax.set_ylim(0, 1.25 * max(max(measured), max(book)) / 2**20)  # room for the legend
    ax.set_title(args.title or "Memory per category: measured against the formula")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    save(fig, args)


def parse_comm(lines):
    """(label, measured bytes, formula bytes or None) per collective, from the report's tables."""
    table, rows, section, sync = {}, [], None, {}
    for line in lines:
        if line.startswith("communication per step"):
            section = "all"
        elif line.startswith("ZeRO-"):
            section = "zero"
        elif line.startswith("tensor-parallel traffic"):
            section = "tp"
        elif not line.startswith(" "):
            section = None
        if section == "all":
            m = re.match(r"\s+(\w+)\s+(\d+)\s+(\w+)\s+[\d.]+\s+[\d.]+\s+([\d.]+ \w+)\s", line)
            if m:
                table[(m.group(1), m.group(3))] = human(m.group(4))
            if m := re.match(r"\s+gradient sync over (\w+)", line):
                sync["group"] = m.group(1)
            if m := re.match(r"\s+ring all-reduce 2\(N-1\)K/N = ([\d.]+ \w+)", line):
                sync[sync.pop("group")] = human(m.group(1))
        elif section == "zero":
            m = re.match(r"\s+(reduce_scatter|all_gather)\s+[\d.]+\s+([\d.]+)\s+\d+\s+(\d+)",
                         line)
            if m:
                rows.append((f"ZeRO {m.group(1)}, training", float(m.group(2)), float(m.group(3))))
        elif section == "tp":
            m = re.match(r"\s+(\w+)\s+[\d.]+ calls .* bytes\s+([\d.]+ \w+), model's count\s+"
                         r"([\d.]+ \w+)", line)
            if m and (human(m.group(2)) or human(m.group(3))):
                rows.append((f"tp {m.group(1)}, training", human(m.group(2)), human(m.group(3))))
    # Every group's collectives as measured (validation included); then, without ZeRO, each
    # gradient sync (the group's collectives summed) against the book's ring all-reduce
    # 2(N-1)K/N; ZeRO's own table replaces it; then the tp table, training only.
    out = [(f"{group} {coll}, every call", got, None)
           for (group, coll), got in table.items() if got > 0]
    if not any(label.startswith("ZeRO") for label, _, _ in rows):
        for group, want in sync.items():
            got = sum(b for (g, _), b in table.items() if g == group)
            out.append((f"{group} gradient sync, every call summed", got, want))
    return out + rows


def plot_comm(args):
    rows = parse_comm(read_text(args.report))
    if not rows:
        fail(f"{args.report}: no communication table (one rank sends nothing); save "
                 "the output of mpirun -np N ./train ... --report comm to the file")
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.6))
    y = range(len(rows))
    ax.barh([i - 0.2 for i in y], [r[1] / 2**20 for r in rows], 0.4, color="#4c8bd6",
            label="measured on rank 0 (collectives charged by the ring's share)")
    ax.barh([i + 0.2 for i in y], [(r[2] or 0) / 2**20 for r in rows], 0.4, color="#cccccc",
            edgecolor="black", hatch="//", label="the book's formula")
    ax.set_yticks(list(y))
    ax.set_yticklabels([r[0] for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("MiB sent per rank per step (every call: validation included)")
    ax.set_title(args.title or "Communication per step: measured against the formula")
    fig.legend(fontsize=8, loc="lower center", ncol=2, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    save(fig, args, bottom=0.3 / fig.get_figheight())


# ----------------------------------------------------------------------------
# The planner's heatmap of the book's campaign: model x nodes, coloured by predicted MFU.


def plot_heatmap(args):
    cells = read_json(args.campaign, "./plan --campaign tests/data/book_campaign.csv --json FILE")
    if not isinstance(cells, list) or not cells or "model" not in cells[0]:
        fail(f"{args.campaign}: not a campaign; give the file "
                 "./plan --campaign tests/data/book_campaign.csv --json FILE wrote")
    models = list(dict.fromkeys(c["model"] for c in cells))  # the table's order
    nodes = sorted({c["nodes"] for c in cells})
    grid = [[float("nan")] * len(nodes) for _ in models]
    fig, ax = plt.subplots(figsize=(1.9 * len(nodes) + 1.5, 1.0 * len(models) + 1.4))
    for c in cells:
        i, j = models.index(c["model"]), nodes.index(c["nodes"])
        best = c.get("best")
        if best:
            grid[i][j] = 100 * best["mfu"]
            text = (f"dp{best['dp']} tp{best['tp']}{'+sp' if best['sp'] else ''} pp{best['pp']}\n"
                    f"z{best['zero']} mbs{best['mbs']} ga{best['grad_acc']}\n"
                    f"{100 * best['mfu']:.1f}%")
            if c.get("book"):
                text += f" (book {100 * c['book']['mfu']:.1f}%)"
        else:
            text = "nothing fits"
        ax.text(j, i, text, ha="center", va="center", fontsize=7)
    image = ax.imshow(grid, cmap="viridis", alpha=0.75, aspect="auto")
    ax.set_facecolor("#e8e8e8")  # cells where nothing fits
    fig.colorbar(image, ax=ax, label="planner's predicted MFU (%)")
    ax.set_xticks(range(len(nodes)))
    ax.set_xticklabels([str(n) for n in nodes])
    ax.set_yticks(range(len(models)))
    ax.set_yticklabels(models)
    ax.set_xlabel("nodes of 8 GPUs")
    ax.set_ylabel("model")
    ax.set_title(args.title or "The planner's best layout per cell of the book's campaign "
                 "(its predicted MFU; in brackets the book's measured best)")
    save(fig, args)


# ----------------------------------------------------------------------------


def finite(v):  # JSON has no NaN: a cell left empty is null
    v = float(v)
    return v if v == v else None


def figure_data(fig):
    """What the figure draws, per axes, read back from its artists (not from our inputs)."""
    out = []
    for ax in fig.axes:
        a = {"title": ax.get_title(), "xlabel": ax.get_xlabel(), "ylabel": ax.get_ylabel(),
             "xticklabels": [t.get_text() for t in ax.get_xticklabels()],
             "yticklabels": [t.get_text() for t in ax.get_yticklabels()],
             "lines": [{"label": ln.get_label(), "x": [finite(v) for v in ln.get_xdata()],
                        "y": [finite(v) for v in ln.get_ydata()]}
                       for ln in ax.get_lines()],
             "bars": [], "spans": [], "images": [],
             "texts": [{"x": finite(t.get_position()[0]), "y": finite(t.get_position()[1]),
                        "text": t.get_text()} for t in ax.texts]}
        for c in ax.containers:
            if isinstance(c, BarContainer):
                a["bars"].append({"label": c.get_label(),
                                  "x": [finite(r.get_x()) for r in c.patches],
                                  "y": [finite(r.get_y()) for r in c.patches],
                                  "width": [finite(r.get_width()) for r in c.patches],
                                  "height": [finite(r.get_height()) for r in c.patches]})
        for coll in ax.collections:  # broken_barh: one rectangle per span
            if coll.get_label().startswith("_span"):
                for path in coll.get_paths():
                    xs, ys = path.vertices[:, 0], path.vertices[:, 1]
                    a["spans"].append({"row": coll.get_label()[len("_span "):],
                                       "start": finite(xs.min()),
                                       "width": finite(xs.max() - xs.min()),
                                       "y": finite(ys.min()), "height": finite(ys.max() - ys.min())})
        for im in ax.images:
            a["images"].append([[finite(v) for v in row] for row in im.get_array().filled(float("nan"))])
        out.append(a)
    return out


def write_file(path, flag, write):
    # As ./train writes its outputs: through a symlink to its target, replacing only a regular
    # file, atomically (a temporary renamed over it); a device or a directory is refused.
    target = os.path.realpath(path)
    if os.path.exists(target) and not os.path.isfile(target):
        fail(f"{flag} {path}: {target} is not a regular file; outputs only replace regular "
             "files: name a file")
    tmp = f"{target}.tmp.{os.getpid()}"
    write(tmp)
    os.replace(tmp, target)
    print(f"wrote {path}")


def save(fig, args, bottom=0.0):  # bottom: the figure's share kept for a legend under the axes
    fig.tight_layout(rect=(0, bottom, 1, 1))
    write_file(args.output, "-o", lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    if args.data:
        data = {"command": args.command, "axes": figure_data(fig)}
        write_file(args.data, "--data", lambda tmp: open(tmp, "w").write(json.dumps(data, indent=1, allow_nan=False)))
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(
        description="picoscale's pictures, each from what ./train or ./plan writes (tools/README.md)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("loss", help="--log-json files' loss per step, overlaid")
    p.add_argument("logs", nargs="+")
    p.add_argument("--labels", nargs="+")
    p.set_defaults(run=plot_loss)
    p = sub.add_parser("schedule", help="a --trace file's pipeline schedule, one row per rank")
    p.add_argument("trace")
    p.add_argument("--step", type=int, default=0, help="the step to draw (default: the last)")
    p.add_argument("--ticks", action="store_true",
                   help="re-time the measured order as the book draws it (--pp runs only)")
    p.set_defaults(run=plot_schedule)
    p = sub.add_parser("memory", help="--report memory's text: measured against the formula")
    p.add_argument("report")
    p.set_defaults(run=plot_memory)
    p = sub.add_parser("comm", help="--report comm's text: measured against the formula")
    p.add_argument("report")
    p.set_defaults(run=plot_comm)
    p = sub.add_parser("heatmap", help="./plan --campaign ... --json FILE: model x nodes")
    p.add_argument("campaign")
    p.set_defaults(run=plot_heatmap)
    for p in sub.choices.values():
        p.add_argument("-o", "--output", required=True, help="the PNG to write")
        p.add_argument("--title")
        p.add_argument("--data", help="also write what the picture draws, as JSON")
    args = parser.parse_args()
    check_paths(args)
    try:
        args.run(args)
    except FileNotFoundError as e:
        fail(f"{e.filename}: no such file")
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        # JSON of another shape than the file the subcommand reads (a list for an object, a
        # span without a name): named, not a traceback.
        fail(f"{' '.join(inputs_of(args))}: not what {args.command} reads ({type(e).__name__}: "
             f"{e}); give it the file its help names")


def inputs_of(args):
    """The files a subcommand reads."""
    return {"loss": lambda: args.logs, "schedule": lambda: [args.trace],
            "memory": lambda: [args.report], "comm": lambda: [args.report],
            "heatmap": lambda: [args.campaign]}[args.command]()


def check_paths(args):
    """Every input a regular file (a FIFO would block the read), and no output over an input or
    over the other output: a picture never replaces the log it was drawn from."""
    for path in inputs_of(args):
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            fail(f"{path}: no such file")
        except OSError as e:
            fail(f"{path}: cannot be read ({e.strerror})")
        if not stat.S_ISREG(mode):
            fail(f"{path}: not a regular file (a FIFO, a device or a directory); give the file "
                 "itself")

    def same(a, b):
        if os.path.exists(a) and os.path.exists(b):
            return os.path.samefile(a, b)
        return os.path.realpath(a) == os.path.realpath(b)

    outputs = [("-o", args.output)] + ([("--data", args.data)] if args.data else [])
    for flag, out in outputs:
        for path in inputs_of(args):
            if same(out, path):
                fail(f"{flag} {out} would overwrite {path}, which this command reads: they are "
                     "the same file; write the output elsewhere")
    if args.data and same(args.output, args.data):
        fail(f"-o {args.output} and --data {args.data} are the same file: give each its own name")


if __name__ == "__main__":
    main()
