"""Render the report's results (the dict bench/report.py writes to results.json) into
``results.md`` (tables), ``results-summary.md`` (a few lines for the README) and PNG figures.
Every number comes from the results; every figure carries machine, kernel and date."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

SCHEMES = ("pcce", "valence", "hcce")
LABEL = {"pcce": "PCCE", "valence": "Valence", "hcce": "HCCE", "plain": "plain (1 word/frame)"}
COLORS = {"pcce": "#d62728", "valence": "#1f77b4", "hcce": "#2ca02c", "plain": "#7f7f7f"}
VARIANTS = [
    ("every_call", "every call site probed"),
    ("get_stack", "bpf_get_stack (FP) at syscalls"),
    ("strace", "strace -f -k"),
    ("instrumented", "instrumented (Valence)"),
    ("instrumented_pcce", "instrumented PCCE"),
    ("instrumented_hcce", "instrumented HCCE"),
    ("instrumented_hot", "instrumented, hot-edge zero codes"),
    ("instrumented_scope", "instrumented --scope"),
    ("unwind", "unwind"),
]
FIGURES = {
    "fig4": "report-fig4-lengths.png",
    "fig5": "report-fig5-average.png",
    "fig6": "report-fig6-overhead.png",
    "fig7b": "report-fig7b-query.png",
}
VALENCE_TARGET = 0.5
# instrumented-mode variants of the cost tables: Valence (the default plan), PCCE, HCCE, then Valence
# with hot-edge zero codes and with --scope
INSTRUMENTED_VARIANTS = ("instrumented", "instrumented_pcce", "instrumented_hcce", "instrumented_hot",
                         "instrumented_scope")


# ------------------------------------------------------------------------------------ helpers
def machine_line(meta: Mapping[str, Any]) -> str:
    return (
        f"{meta.get('host')}: {meta.get('cpus')} CPUs ({meta.get('cpu_model') or 'unknown CPU'}), "
        f"{meta.get('memory')}, kernel {meta.get('kernel')}, Python {meta.get('python')}, "
        f"{meta.get('date')}, commit {meta.get('commit')}"
    )


def nm(v: Any) -> str | None:
    """The reason when ``v`` is a not-measured marker."""
    if isinstance(v, Mapping) and "not_measured" in v:
        return f"not measured: {v['not_measured']}"
    return None


def num(v: Any, digits: int = 2) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if v != 0 and abs(v) >= 1000:
            return f"{v:,.0f}"
        return f"{v:.{digits}f}"
    return str(v)


def ratio(v: Mapping[str, Any] | None, key: str = "ratio_wall") -> str:
    if v is None:
        return "–"
    reason = nm(v)
    if reason:
        return reason
    r = v.get(key)
    return f"{r:.2f}×" if isinstance(r, (int, float)) else "–"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
    return out


def footer(fig: Any, meta: Mapping[str, Any]) -> None:
    fig.text(0.01, 0.005, machine_line(meta), fontsize=7, color="#444444", ha="left", va="bottom")


def measured_workloads(results: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [w for w in results.get("workloads", []) if "error" not in w]


# ------------------------------------------------------------------------------------ figures
def fig_lengths(results: Mapping[str, Any], path: Path) -> bool:
    wls = [
        w
        for w in measured_workloads(results)
        if isinstance(w.get("lengths"), Mapping) and w["lengths"].get("hist", {}).get("syscall")
    ]
    if not wls:
        return False
    cols = 3
    rows = math.ceil(len(wls) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows + 0.6), squeeze=False)
    for ax, w in zip(axes.flat, wls, strict=False):
        hist = w["lengths"]["hist"]["syscall"]
        for key in ("plain", *SCHEMES):
            h = hist.get(key)
            if not h:
                continue
            xs = sorted(int(k) for k in h)
            ax.plot(
                xs,
                [h[str(x)] for x in xs],
                marker="o",
                ms=3,
                lw=1.2,
                color=COLORS[key],
                label=LABEL[key],
                ls="--" if key == "plain" else "-",
            )
        ax.set_yscale("log")
        ax.set_title(w["name"], fontsize=9)
        ax.set_xlabel("context length (64-bit words)", fontsize=8)
        ax.set_ylabel("syscall samples", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(wls) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(
        "Figure 4: encoding length at every sampled syscall (same samples re-encoded per scheme)", fontsize=10
    )
    footer(fig, results["meta"])
    fig.tight_layout(rect=(0, 0.02, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def fig_average(results: Mapping[str, Any], path: Path) -> bool:
    wls = [
        w
        for w in measured_workloads(results)
        if isinstance(w.get("lengths"), Mapping)
        and w["lengths"].get("average", {}).get("valence") is not None
    ]
    if not wls:
        return False
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(wls) + 2), 4.2))
    keys = ("plain", *SCHEMES)
    width = 0.8 / len(keys)
    for i, key in enumerate(keys):
        vals = [w["lengths"]["average"].get(key) or 0 for w in wls]
        xs = [j + (i - (len(keys) - 1) / 2) * width for j in range(len(wls))]
        ax.bar(xs, vals, width, color=COLORS[key], label=LABEL[key])
    ax.set_xticks(range(len(wls)))
    ax.set_xticklabels([w["name"] for w in wls], rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("average context length (words)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title("Figure 5: average encoding length per syscall sample", fontsize=10)
    footer(fig, results["meta"])
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def fig_overhead(results: Mapping[str, Any], path: Path) -> bool:
    wls = measured_workloads(results)
    if not wls:
        return False
    fig, axes = plt.subplots(2, 1, figsize=(max(7.0, 1.3 * len(wls) + 3), 8.0), sharex=True)
    width = 0.8 / len(VARIANTS)
    cmap = plt.get_cmap("tab10")
    for ax, key, ylabel in (
        (axes[0], "ratio_wall", "wall time / untraced"),
        (axes[1], "ratio_cpu", "CPU time / untraced"),
    ):
        for i, (vk, vlabel) in enumerate(VARIANTS):
            xs, ys = [], []
            for j, w in enumerate(wls):
                v = w.get("variants", {}).get(vk, {})
                r = v.get(key) if isinstance(v, Mapping) else None
                if isinstance(r, (int, float)) and r > 0:
                    xs.append(j + (i - (len(VARIANTS) - 1) / 2) * width)
                    ys.append(r)
            ax.bar(xs, ys, width, color=cmap(i), label=vlabel)
        ax.axhline(1.0, color="black", lw=0.6)
        ax.set_yscale("log")
        ax.set_ylabel(ylabel)
    axes[0].legend(fontsize=7, ncol=2)
    axes[1].set_xticks(range(len(wls)))
    axes[1].set_xticklabels([w["name"] for w in wls], rotation=25, ha="right", fontsize=8)
    fig.suptitle(
        "Figure 6: cost of obtaining calling contexts, relative to the untraced run "
        "(median of repeats; bars missing = not measured)",
        fontsize=10,
    )
    footer(fig, results["meta"])
    fig.tight_layout(rect=(0, 0.02, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def fig_query(results: Mapping[str, Any], path: Path) -> bool:
    q = results.get("query")
    have_bpf = isinstance(q, Mapping) and q.get("rows")
    decode = [(w["name"], w["decode_ns"]) for w in measured_workloads(results) if w.get("decode_ns")]
    if not have_bpf and not decode:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    ax = axes[0]
    if have_bpf and isinstance(q, Mapping):
        rows = q["rows"]
        depths = sorted(int(d) for d in rows)
        for key, label, color in (
            ("instrumented_bpf_ns", "instrumented: read + emit Valence context", "#1f77b4"),
            ("unwind_bpf_ns", "unwind: CFI walk + encode in BPF", "#ff7f0e"),
            ("get_stack_bpf_ns", "bpf_get_stack (FP, ≤127 frames)", "#7f7f7f"),
        ):
            pts = [(d, rows[str(d)].get(key)) for d in depths]
            pts = [(d, v) for d, v in pts if isinstance(v, (int, float))]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label, color=color)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("frames on the stack at the sample")
        ax.set_ylabel("BPF ns per sample (bpf_stats)")
        ax.legend(fontsize=7)
        ax.set_title("(b1) query in BPF at a getppid() sample", fontsize=9)
    else:
        ax.text(0.5, 0.5, "not measured", ha="center")
    ax = axes[1]
    for scheme in SCHEMES:
        xs, ys = [], []
        for _, d in decode:
            for words, ns in d.get(scheme, []):
                if isinstance(ns, (int, float)) and not math.isnan(ns):
                    xs.append(words)
                    ys.append(ns)
        if xs:
            ax.scatter(xs, ys, s=6, alpha=0.5, color=COLORS[scheme], label=LABEL[scheme])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("context length (words)")
    ax.set_ylabel("ns per decode (userspace, no cache)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    ax.set_title("(b2) decoding a context in userspace, all workloads", fontsize=9)
    fig.suptitle("Figure 7b: cost of one calling-context query against context length", fontsize=10)
    footer(fig, results["meta"])
    fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------------- markdown
def md_static(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    out = [
        "## 1. Static statistics (Table 1)",
        "",
        "Call graphs as `ccprofd analyze` builds them (virtual root included; `instrumented` = edges "
        "probed for the encoding's own sake). Stack tags: distinct root paths (function sequences from "
        "a root function, 1–10 functions, parallel edges once) counted by dynamic programming; "
        "collisions among their 64-bit tags (`T = T·11 ⊕ id(f)`) enumerated when there are ≤ 10⁸ "
        "paths (`paths − distinct tags`), else estimated from uniformly sampled paths "
        "(colliding pairs among the sample × P²/N²; marked ≈, with the pairs found in N samples).",
        "",
    ]
    header = [
        "binary",
        "nodes",
        "edges",
        "SCCs",
        "complex SCCs",
        "cyclic edges",
        "acyclic bits PCCE",
        "Valence",
        "HCCE",
        "instrumented PCCE",
        "Valence",
        "HCCE",
        "root paths ≤10",
        "at depth 10",
        "tag collisions",
    ]
    body = []
    for r in rows:
        reason = nm(r.get("result"))
        if reason:
            body.append([f"`{r['binary']}`", reason] + [""] * (len(header) - 2))
            continue
        st = r["stacktags"]
        if st["estimate"]:
            coll = (
                f"≈ {num(st['collisions'], 1)} (est.: {st['sample_colliding_pairs']} pairs in "
                f"{st['examined']:,} sampled)"
            )
        else:
            coll = f"{int(st['collisions']):,} (all {st['examined']:,} enumerated)"
        bits = [f"{r[f'acyclic_bits_{s}']}" + (" (overflow)" if r[f"overflow_{s}"] else "") for s in SCHEMES]
        body.append(
            [
                f"`{r['binary']}`",
                num(r["nodes"]),
                num(r["edges"]),
                num(r["sccs"]),
                num(r["complex_sccs"]),
                num(r["cyclic_edges"]),
                *bits,
                *(num(r[f"instrumented_{s}"]) for s in SCHEMES),
                num(st["paths"]),
                num(st["paths_at_depth"]),
                coll,
            ]
        )
    out += table(header, body)
    out += [
        "",
        "`(overflow)`: the PCCE/HCCE id needs more than one 64-bit word; the dynamic measurements "
        "below give those plans as many words as they need.",
    ]
    return out


def md_lengths(wls: Sequence[Mapping[str, Any]]) -> list[str]:
    out = [
        "## 2. Dynamic encoding length (Figures 4–5)",
        "",
        "Every syscall of each workload was sampled by `ccprofd trace` (instrumented mode); each "
        "sample's decoded frames give the exact call path of the real run, which is re-encoded under "
        "each scheme's plan with `ccprofd.encode.Encoder` (the probes' reference semantics) and "
        "measured with `EncodedState.context_words()`. So the lengths are those every scheme would "
        "have had *at the same samples*; only the Valence state was maintained live (and each "
        "re-encoded Valence state is checked to decode back to the traced path: `round trip`). "
        "Plain = one word per frame. *Segments*: entries from code ccprofd did not analyse or through "
        "calls with no graph edge (function pointers, callbacks); each costs 2 words under every scheme, "
        "so where they dominate no scheme can be much shorter than another. Incomplete samples "
        "(flagged by ccprofd) and samples with no frame of the binary (loader, exit) are not counted.",
        "",
    ]
    header = [
        "workload",
        "samples used / all",
        "plain avg (max)",
        "segments avg",
        "PCCE avg (max)",
        "Valence avg (max)",
        "HCCE avg (max)",
        "Valence / PCCE",
        "target ≤ 0.5 (recursive)",
        "round trip",
    ]
    body = []
    for w in wls:
        L = w.get("lengths")
        reason = nm(L) if L is not None else "not measured"
        if reason or L is None:
            body.append([w["name"], reason or "–"] + [""] * (len(header) - 2))
            continue
        avg, mx = L["average"], L["max"]
        cells = [f"{num(avg.get(k))} ({num(mx.get(k))})" for k in ("plain", *SCHEMES)]
        cells.insert(1, num(avg.get("segments")))
        r = (avg["valence"] / avg["pcce"]) if avg.get("valence") and avg.get("pcce") else None
        target = (
            ("met" if r is not None and r <= VALENCE_TARGET else "**missed**") if w.get("recursive") else "–"
        )
        rt = f"{L['roundtrip_checked'] - L['roundtrip_failures']}/{L['roundtrip_checked']} contexts"
        body.append([w["name"], f"{L['used']:,} / {L['samples']:,}", *cells, num(r), target, rt])
    out += table(header, body)
    cpu_rows = []
    for w in wls:
        L = w.get("lengths_cpu")
        if isinstance(L, Mapping) and L.get("used"):
            avg, mx = L["average"], L["max"]
            cpu_rows.append(
                [
                    w["name"],
                    f"{L['used']:,} / {L['samples']:,}",
                    *(f"{num(avg.get(k))} ({num(mx.get(k))})" for k in ("plain", *SCHEMES)),
                ]
            )
    out += [
        "",
        "At CPU-clock (perf) samples, taken by unwind mode (`--sample-hz`), re-encoded the same way:",
        "",
    ]
    if cpu_rows:
        out += table(["workload", "samples used / all", "plain", "PCCE", "Valence", "HCCE"], cpu_rows)
    else:
        out += [
            "not measured: no CPU sample had a frame of the traced binary (runs too short, or unwind mode "
            "unavailable)."
        ]
    out += ["", f"![Figure 4]({FIGURES['fig4']})", "", f"![Figure 5]({FIGURES['fig5']})"]
    return out


def md_cost(wls: Sequence[Mapping[str, Any]], meta: Mapping[str, Any]) -> list[str]:
    out = [
        "## 3. Instrumentation cost (Figure 6)",
        "",
        f"Time of the traced command relative to the untraced one (median of {meta.get('repeat')} runs, "
        f"untraced: median of {meta.get('untraced_repeat')}); `wall (CPU)`, CPU = user + sys of the target "
        "from `wait4` (uprobe traps and BPF programs run in its context; ccprofd's own decoding runs in "
        "the tracer process and is not in it). All variants run in the same report, launched the same "
        "way, with `kernel.bpf_stats_enabled=1` throughout. *Every call site*: a counting uprobe on "
        "every direct `call`/tail `jmp` of the binary (these counts are the *function calls* below and "
        "the edge weights of the hot-edge variant). *bpf_get_stack*: a frame-pointer walk at every "
        "syscall, stacks drained from a ring buffer (Debian binaries have no frame pointers: it is "
        "cheap and wrong). Unwind mode runs with CPU-clock sampling at "
        f"{meta.get('cpu_sample_hz')} Hz. strace: one run (it is also the correctness oracle).",
        "",
    ]
    header = [
        "workload",
        "untraced s",
        "function calls",
        "syscalls",
        "calls / syscall",
        *(lbl for _, lbl in VARIANTS),
    ]
    body = []
    for w in wls:
        v = w.get("variants", {})
        u = v.get("untraced", {})
        cells = [
            f"{ratio(v.get(k))} ({ratio(v.get(k), 'ratio_cpu')})" if not nm(v.get(k)) else str(nm(v.get(k)))
            for k, _ in VARIANTS
        ]
        body.append(
            [
                w["name"],
                num(u.get("seconds"), 3) if not nm(u) else str(nm(u)),
                num(w.get("calls")),
                num(w.get("syscalls")),
                num(w.get("calls_per_syscall"), 0),
                *cells,
            ]
        )
    out += table(header, body)
    out += [
        "",
        "Probe hits per 1,000 function calls (instrumented variants; every call site = 1,000 by "
        "definition) and the tracer's one-time set-up (analysis from cache, plan, BPF compile, attach):",
        "",
    ]
    body = []
    for w in wls:
        v = w.get("variants", {})
        row = [w["name"]]
        for k in INSTRUMENTED_VARIANTS:
            x = v.get(k, {})
            row.append(num(x.get("hits_per_1000_calls"), 0) if isinstance(x, Mapping) else "–")
        for k in (*INSTRUMENTED_VARIANTS, "unwind"):
            x = v.get(k, {})
            row.append(num(x.get("prepare_seconds"), 1) if isinstance(x, Mapping) else "–")
        body.append(row)
    out += table(
        [
            "workload",
            "hits/1k calls: Valence",
            "PCCE",
            "HCCE",
            "hot-edge",
            "--scope",
            "set-up s: Valence",
            "PCCE",
            "HCCE",
            "hot-edge",
            "--scope",
            "unwind",
        ],
        body,
    )
    out += [
        "",
        "Per scheme (the paper's Figure 6 bars): the same instrumented mode maintaining a PCCE or HCCE "
        "plan live (`--encoding pcce|hcce`). Probes go on the edges whose code is not zero, so each "
        "scheme probes a different set: PCCE's zero edge is each node's first incoming edge, Valence's "
        "and HCCE's the heaviest incoming edge of each node / component, and every cyclic (PCCE: back) "
        "edge is probed. The trap dominates the cost (the BPF body is a few ns), so a scheme costs what "
        "its probe hits cost; PCCE's back edges also push a wider record (saved id + code) per "
        "recursive call. Section 5 checks each scheme's samples against `strace -k`.",
        "",
        f"![Figure 6]({FIGURES['fig6']})",
    ]
    return out


def mode_choice(w: Mapping[str, Any]) -> dict[str, Any] | None:
    v = w.get("variants", {})
    i, u = v.get("instrumented", {}), v.get("unwind", {})
    if nm(i) or nm(u) or "cpu" not in i or "cpu" not in u:
        return None
    ci, cu = i["cpu"], u["cpu"]
    wi, wu = i["seconds"], u["seconds"]
    cheaper = "unwind" if cu < ci else "instrumented"
    by = (max(ci, cu) / min(ci, cu)) if min(ci, cu) > 0 else None
    wall_agrees = (wu < wi) == (cu < ci)
    return {"cheaper": cheaper, "by": by, "wall_agrees": wall_agrees, "cpu": (ci, cu), "wall": (wi, wu)}


def md_modes(wls: Sequence[Mapping[str, Any]]) -> list[str]:
    out = [
        "### Mode choice",
        "",
        "Which mode costs the traced program less, by its CPU time (user + sys, robust against the "
        "machine's other load); wall times beside it. Instrumented mode pays per probed call, unwind "
        "mode per sample, so calls per syscall decides.",
        "",
    ]
    body = []
    for w in wls:
        mc = mode_choice(w)
        v = w.get("variants", {})
        if mc is None:
            reason = nm(v.get("unwind")) or nm(v.get("instrumented")) or "not measured"
            body.append([w["name"], num(w.get("calls_per_syscall"), 0), reason, "", ""])
            continue
        ci, cu = mc["cpu"]
        wi, wu = mc["wall"]
        body.append(
            [
                w["name"],
                num(w.get("calls_per_syscall"), 0),
                f"{num(ci, 3)} s / {num(cu, 3)} s",
                f"{num(wi, 3)} s / {num(wu, 3)} s",
                f"**{mc['cheaper']}**, {num(mc['by'])}× less CPU"
                + ("" if mc["wall_agrees"] else " (wall disagrees)"),
            ]
        )
    out += table(
        ["workload", "calls / syscall", "CPU instrumented / unwind", "wall instrumented / unwind", "cheaper"],
        body,
    )
    return out


def honesty_notes(wls: Sequence[Mapping[str, Any]]) -> list[str]:
    """Sentences generated from the numbers: where a ccprofd mode is slower than a baseline, by how
    much, and the measured reason."""
    notes = []
    for w in wls:
        v = w.get("variants", {})
        for mode in ("instrumented", "unwind"):
            m = v.get(mode, {})
            if nm(m) or "ratio_wall" not in m:
                continue
            worse = []
            for base, label in (
                ("every_call", "probing every call site"),
                ("get_stack", "bpf_get_stack"),
                ("strace", "strace -f -k"),
            ):
                b = v.get(base, {})
                if not nm(b) and "ratio_wall" in b and m["ratio_wall"] > b["ratio_wall"]:
                    worse.append(
                        f"{label} {b['ratio_wall']:.2f}× ({m['ratio_wall'] / b['ratio_wall']:.1f}× more)"
                    )
            if not worse:
                continue
            if mode == "instrumented":
                hits = m.get("hits_per_1000_calls")
                why = (
                    f"it pays a uprobe trap per probed call: {num(hits, 0)} probe hits per 1,000 calls "
                    f"at {num(w.get('calls_per_syscall'), 0)} calls per syscall, while a walk pays only "
                    "at syscalls"
                )
                if hits and hits > 1000:
                    why += (
                        "; more hits than calls, because entry probes (functions entered from outside "
                        "code or through function pointers) and exit probes on library calls come on top "
                        "of call sites, and entry probes on instructions the kernel cannot emulate are "
                        "single-stepped"
                    )
            else:
                why = "it unwinds the whole stack with CFI and encodes it in BPF at every sample"
            notes.append(
                f"- `{w['name']}`: {mode} mode {m['ratio_wall']:.2f}× the untraced wall time, worse "
                f"than {', '.join(worse)}: {why}."
            )
    return notes or ["- ccprofd was not slower than any baseline on any workload in this run."]


def md_query(results: Mapping[str, Any], wls: Sequence[Mapping[str, Any]]) -> list[str]:
    out = ["## 4. Query cost (Figure 7b)", ""]
    q = results.get("query")
    reason = nm(q.get("result")) if isinstance(q, Mapping) else "not measured"
    if reason or not isinstance(q, Mapping):
        out.append(reason or "not measured")
    else:
        out += [
            f"BPF run time per sample (`kernel.bpf_stats_enabled`: the sampling program's run time over "
            f"the samples taken, less its runs for other processes' syscalls at the filter cost measured "
            f"while idle) at `getppid()` in bench/unwind.py's test program, up to {q['calls']:,} "
            "calls per depth (fewer on deep stacks); the instrumented program reads the per-thread "
            "Valence state and emits it, unwind mode walks and encodes the stack. Context length of the "
            "same samples re-encoded.",
            "",
        ]
        for key in ("instrumented_not_measured", "unwind_not_measured"):
            if key in q:
                out.append(f"{key.split('_')[0]} mode: not measured: {q[key]}")
        body = []
        for d in sorted(q["rows"], key=int):
            r = q["rows"][d]
            body.append(
                [
                    d,
                    num(r.get("calls")),
                    num(r.get("frames"), 0),
                    num(r.get("valence_words"), 1),
                    num(r.get("pcce_words"), 1),
                    num(r.get("instrumented_bpf_ns"), 0),
                    num(r.get("unwind_bpf_ns"), 0),
                    f"{num(r.get('get_stack_bpf_ns'), 0)} ({num(r.get('get_stack_frames'), 0)} frames)",
                    num(r.get("untraced_wall_ns_per_call"), 0),
                    num(r.get("instrumented_wall_ns_per_call"), 0),
                    num(r.get("unwind_wall_ns_per_call"), 0),
                    num(r.get("get_stack_wall_ns_per_call"), 0),
                ]
            )
        out += table(
            [
                "frames",
                "calls",
                "frames of the binary",
                "Valence words",
                "PCCE words",
                "BPF ns: instrumented",
                "unwind",
                "bpf_get_stack",
                "wall ns/call: untraced",
                "instrumented",
                "unwind",
                "bpf_get_stack",
            ],
            body,
        )
    out += [
        "",
        "Userspace decoding (`decoder_for(plan).decode`, no cache, best of 3) of the distinct contexts "
        "of each workload, median ns and average words:",
        "",
    ]
    body = []
    for w in wls:
        d = w.get("decode_ns")
        if not d:
            continue
        row = [w["name"]]
        for s in SCHEMES:
            pts = [
                (words, ns)
                for words, ns in d.get(s, [])
                if isinstance(ns, (int, float)) and not math.isnan(ns)
            ]
            if not pts:
                row.append("–")
                continue
            ns_sorted = sorted(p[1] for p in pts)
            row.append(
                f"{ns_sorted[len(ns_sorted) // 2] / 1000:.1f} µs ({sum(p[0] for p in pts) / len(pts):.1f} w)"
            )
        body.append(row)
    out += table(["workload", "PCCE", "Valence", "HCCE"], body)
    out += [
        "",
        "BPF time per sample inside each workload's own run, bounded: the syscall program also runs (and "
        "returns at once) for every syscall of every other process, so run time / samples is an upper "
        "bound and run time / runs a lower one (the query-cost table above isolates it):",
        "",
    ]
    body = []
    for w in wls:
        v = w.get("variants", {})
        row = [w["name"]]
        for mode, prog in (("instrumented", "ccprof_sys_enter"), ("unwind", "uw_sys_enter")):
            m = v.get(mode, {})
            tc = m.get("bpf", {}).get(prog) if isinstance(m, Mapping) else None
            n = m.get("samples") if isinstance(m, Mapping) else None
            row.append(f"{num(tc[0] / tc[1], 0)} – {num(tc[0] / n, 0)}" if tc and n and tc[1] else "–")
        L = w.get("lengths")
        row.append(num(L["average"].get("valence")) if isinstance(L, Mapping) and "average" in L else "–")
        body.append(row)
    out += table(["workload", "instrumented ns/sample", "unwind ns/sample", "Valence words"], body)
    out += ["", f"![Figure 7b]({FIGURES['fig7b']})"]
    return out


def md_fidelity(wls: Sequence[Mapping[str, Any]]) -> list[str]:
    out = [
        "## 5. Correctness alongside",
        "",
        "Each mode's samples of the first timed run against `strace -f -k` of the same command (every "
        "syscall ccprofd saw; a separate run of a deterministic command), compared sample by sample with "
        "the test suite's oracle (`tests/fidelity.py`: syscalls by ordinal per thread, every frame of the "
        "binary by return address and function). *equal*: complete and identical; *incomplete*: flagged "
        "`complete: false` and a correct innermost part; *wrong*: a frame differs.",
        "",
    ]
    body = []
    for w in wls:
        fid = w.get("fidelity") or {}
        for mode in ("instrumented", "instrumented_pcce", "instrumented_hcce", "unwind"):
            f = fid.get(mode)
            if not f:
                continue
            body.append(
                [
                    w["name"],
                    mode,
                    num(f.get("compared")),
                    f"{100 * f['fraction_equal']:.1f} %" if f.get("fraction_equal") is not None else "–",
                    num(f.get("incomplete_ok")),
                    num(f.get("wrong")),
                    f"{num(f.get('missing'))} / {num(f.get('extra'))}",
                    num(f.get("oracle_truncated")),
                ]
            )
    if body:
        out += table(
            [
                "workload",
                "mode",
                "samples compared",
                "equal",
                "incomplete (flagged, correct suffix)",
                "wrong",
                "missing / extra",
                "oracle cut at 256 frames",
            ],
            body,
        )
    else:
        out.append("not measured: no workload produced samples and a strace oracle.")
    ex = [
        (w["name"], m, e)
        for w in wls
        for m, f in (w.get("fidelity") or {}).items()
        for e in (f.get("examples") or [])
    ]
    if ex:
        out += ["", "First mismatches, verbatim from the comparison:", ""]
        for name, mode, e in ex[:6]:
            out += [f"- `{name}` ({mode}):", "", "```", e, "```"]
    return out


def render(results: Mapping[str, Any], out: Path) -> None:
    meta = results["meta"]
    made = {
        "fig4": fig_lengths(results, out / FIGURES["fig4"]),
        "fig5": fig_average(results, out / FIGURES["fig5"]),
        "fig6": fig_overhead(results, out / FIGURES["fig6"]),
        "fig7b": fig_query(results, out / FIGURES["fig7b"]),
    }
    wls = list(results.get("workloads", []))
    failed = [w for w in wls if "error" in w]
    ok = [w for w in wls if "error" not in w]
    flag = " --reduced" if meta.get("reduced") else ""
    lines = [
        "# ccprofd evaluation report",
        "",
        f"Generated by `{meta.get('command')}` (`bench/report.py{flag}`)"
        f" on {machine_line(meta)}; load average {meta.get('load_start', 0):.1f} at the start, "
        f"{meta.get('load_end', 0):.1f} at the end (the machine is shared: wall times carry that noise, "
        f"CPU times less). Whole report: {meta.get('duration_seconds', 0) / 60:.1f} minutes "
        "(target ≤ 20). Raw numbers: `results.json`. The Valence paper's section 6 (Table 1, Figures "
        "4–7) measured SPEC CPU 2017 with a compiler pass; here the same quantities are measured on "
        "installed binaries with no recompilation.",
        "",
    ]
    if failed:
        lines += [
            "Workloads not measured: " + "; ".join(f"`{w['name']}`: {nm(w['error'])}" for w in failed),
            "",
        ]
    if "static" in results:
        lines += [*md_static(results["static"]), ""]
    lines += [*md_lengths(ok), ""]
    lines += [*md_cost(ok, meta), ""]
    lines += [*md_modes(ok), ""]
    lines += ["### Where ccprofd costs more than a baseline", "", *honesty_notes(ok), ""]
    lines += [*md_query(results, ok), ""]
    lines += [*md_fidelity(ok), ""]
    lines += ["## Workloads", ""]
    lines += [
        f"- `{w['name']}`: {w.get('description')} — `{'`, `'.join(w.get('invocations', []))}`; "
        f"--scope `{w.get('scope')}`"
        for w in ok
    ]
    missing = [k for k, v in made.items() if not v]
    if missing:
        lines += ["", "Figures not produced (no data): " + ", ".join(missing)]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    summary = "\n".join(summary_lines(results, made)) + "\n"
    (out / "results-summary.md").write_text(summary)
    if out.resolve() == (Path(__file__).resolve().parent.parent / "docs"):
        from common import update_readme_section  # the README's summary is this file, never typed

        update_readme_section("results", summary)


def summary_lines(results: Mapping[str, Any], made: Mapping[str, bool]) -> list[str]:
    meta = results["meta"]
    ok = [w for w in results.get("workloads", []) if "error" not in w]
    out = [
        f"Measured by `{meta.get('command')}` on {meta.get('host')} ({meta.get('cpus')} CPUs, kernel "
        f"{meta.get('kernel')}, {meta.get('date')}, {meta.get('duration_seconds', 0) / 60:.1f} min); "
        "full tables in [docs/results.md](docs/results.md).",
        "",
    ]
    rec: list[str] = []
    ratios: list[float] = []
    for w in ok:
        L = w.get("lengths")
        if w.get("recursive") and isinstance(L, Mapping) and L.get("average", {}).get("pcce"):
            a = L["average"]
            r = a["valence"] / a["pcce"]
            ratios.append(r)
            why = ""
            if r > VALENCE_TARGET and a.get("segments") is not None:
                why = f", {a['segments']:.1f} segments per sample at 2 words each in every scheme"
            rec.append(f"`{w['name']}` {a['pcce']:.1f} → {a['valence']:.1f} ({r:.2f}×{why})")
    if rec:
        met = all(r <= VALENCE_TARGET for r in ratios)
        out.append(
            f"- **Encoding length** (average words per syscall sample, PCCE → Valence, target ≤ "
            f"{VALENCE_TARGET}×: {'met' if met else 'missed'}): " + "; ".join(rec) + "."
        )
    modes = []
    for w in ok:
        mc = mode_choice(w)
        if mc:
            modes.append(
                f"`{w['name']}` {mc['cheaper']} ({num(mc['by'])}× less CPU, "
                f"{num(w.get('calls_per_syscall'), 0)} calls/syscall)"
            )
    if modes:
        out.append("- **Cheaper mode**: " + "; ".join(modes) + ".")
    over = []
    for w in ok:
        v = w.get("variants", {})
        parts = [
            f"{lbl} {v[k]['ratio_wall']:.1f}×"
            for k, lbl in (("instrumented", "instrumented"), ("unwind", "unwind"), ("strace", "strace -k"))
            if isinstance(v.get(k), Mapping) and "ratio_wall" in v[k]
        ]
        if parts:
            over.append(f"`{w['name']}` " + ", ".join(parts))
    if over:
        out.append("- **Wall time vs untraced**: " + "; ".join(over) + ".")
    hits = []
    for w in ok:
        v = w.get("variants", {})
        cells = [
            f"{lbl} {num(v[k]['hits_per_1000_calls'], 0)}"
            for k, lbl in (("instrumented", "Valence"), ("instrumented_hot", "Valence + hot-edge zero codes"),
                           ("instrumented_pcce", "PCCE"), ("instrumented_hcce", "HCCE"),
                           ("instrumented_scope", "--scope"))
            if isinstance(v.get(k), Mapping) and v[k].get("hits_per_1000_calls") is not None
        ]
        if cells:
            hot = v.get("instrumented_hot")
            verdict = ""
            targeted = str(w["name"]).startswith(("bash", "python"))  # issue 4's target workloads
            if targeted and isinstance(hot, Mapping) and hot.get("hits_per_1000_calls") is not None:
                met = hot["hits_per_1000_calls"] <= 1000 / 3
                verdict = f" (hot-edge target ≤ 333: {'met' if met else 'missed'})"
            per_syscall = ""
            if isinstance(v.get("instrumented"), Mapping) and w.get("syscalls"):
                per = v["instrumented"].get("probe_hits", 0) / max(1, w["syscalls"])
                per_syscall = f", Valence {num(per, 0)} hits per syscall"
            hits.append(f"`{w['name']}` " + ", ".join(cells) + per_syscall + verdict)
    if hits:
        out.append("- **Probe hits per 1,000 function calls** (every call site probed = 1,000): "
                   + "; ".join(hits) + ".")
    tot = {m: [0, 0, 0, 0, 0] for m in ("instrumented", "unwind")}
    for w in ok:
        for m, f in (w.get("fidelity") or {}).items():
            if m in tot and f.get("compared"):
                t = tot[m]
                t[0] += f["compared"]
                t[1] += f["equal"]
                t[2] += f.get("incomplete_ok", 0)
                t[3] += f.get("wrong", 0)
                t[4] += f.get("missing", 0) + f.get("extra", 0)
    fid = [
        f"{m}: of {c:,} samples {e:,} equal to strace -k, {inc:,} flagged incomplete (correct innermost "
        f"part), {wr:,} wrong, {mx:,} missing/extra"
        for m, (c, e, inc, wr, mx) in tot.items()
        if c
    ]
    if fid:
        out.append("- **Correctness**: " + "; ".join(fid) + ".")
    notes = honesty_notes(ok)
    if notes and not notes[0].startswith("- ccprofd was not slower"):
        out.append(
            f"- **Worse than a baseline** in {len(notes)} comparison(s); see "
            "[where ccprofd costs more](docs/results.md#where-ccprofd-costs-more-than-a-baseline)."
        )
    figs = [f"![{k}](docs/{FIGURES[k]})" for k in ("fig5", "fig6") if made.get(k)]
    if figs:
        out += ["", *figs]
    return out
