"""Results -> Markdown, and py-spy's collapsed stacks -> top frames."""

from __future__ import annotations

from collections import Counter
from typing import Any

Json = dict[str, Any]
PROXIES = ("nginx", "sglang-router", "gateway")
MIB = 1 << 20


def _num(v: float | None, fmt: str = "{:,.0f}") -> str:
    return "-" if v is None else fmt.format(v)


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def _med(entry: Json, target: str) -> Json | None:
    t = entry["targets"].get(target)
    if not t or "median" not in t or t["status"] != "ok":
        return None
    median: Json = t["median"]
    return median


def _cell_status(entry: Json, target: str) -> str:
    t = entry["targets"].get(target)
    if t is None:
        return "not run"
    status = str(t["status"])
    return "skipped" if status.startswith("skipped") else "failed" if status != "ok" else "-"


def memory_line(driver: str, res: Json) -> str:
    if driver == "sse":
        per = res.get("per_stream_bytes")
        shown = "-" if per is None else f"{per / 1024:.1f} KiB/stream"
        return f"{res['ok']}/{res['streams']} streams complete, {shown}"
    peak = res.get("peak_over_baseline")
    shown = "-" if peak is None else f"peak +{peak / MIB:.1f} MiB"
    return f"{'complete' if res['complete'] else 'INCOMPLETE'} in {res['seconds']:.1f}s, {shown}"


# -- tables -----------------------------------------------------------------------------------


def _throughput(results: Json) -> list[str]:
    wl = {k: v for k, v in results["workloads"].items() if v.get("driver") != "sse"}
    wl = {k: v for k, v in wl.items() if v.get("driver") != "slow"}
    if not wl:
        return []
    out = [
        "## Throughput: ratio to a direct connection (median of rounds)",
        "",
        "| workload | direct req/s | nginx | sglang-router | gateway "
        "| gateway / nginx | gateway / router |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for entry in wl.values():
        direct = _med(entry, "direct")
        base = direct["rps"] if direct else None
        cells = []
        for p in PROXIES:
            m = _med(entry, p)
            r = _ratio(m["rps"] if m else None, base)
            cells.append(_num(r, "{:.3f}") if r is not None else _cell_status(entry, p))
        gw, ng, rt = (_med(entry, p) for p in ("gateway", "nginx", "sglang-router"))
        vs_n = _ratio(gw["rps"] if gw else None, ng["rps"] if ng else None)
        vs_r = _ratio(gw["rps"] if gw else None, rt["rps"] if rt else None)
        out.append(
            f"| {entry['title']} | {_num(base)} | {' | '.join(cells)} "
            f"| {_num(vs_n, '{:.2f}')} | {_num(vs_r, '{:.2f}')} |"
        )
    return [*out, ""]


def _absolute(results: Json) -> list[str]:
    wl = {k: v for k, v in results["workloads"].items() if v.get("driver") not in ("sse", "slow")}
    if not wl:
        return []
    out = [
        "## Absolute numbers (medians; printed, never asserted)",
        "",
        "Added p50: the target's p50 minus the direct p50 in the same workload. Proxy CPU: "
        "user+system time of the proxy's whole process tree during the run, per request and "
        "as a share of one core. resp MB/s: response bytes received per second. Others: the "
        "most CPU (in cores) that processes outside the benchmark used during any of the "
        "target's runs, on the cores its path uses (the machine may be shared). Steal: the "
        "most CPU (in cores) the hypervisor took from the VM during any of them.",
        "",
        "| workload | target | req/s | resp MB/s | p50 ms | p99 ms | added p50 ms "
        "| proxy CPU us/req | proxy CPU % | proxy RSS MiB | errors | others | steal |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for entry in wl.values():
        direct = _med(entry, "direct")
        for name, t in entry["targets"].items():
            m = _med(entry, name)
            if m is None:
                out.append(f"| {entry['title']} | {name} | {t['status']} |||||||||||")
                continue
            added = None
            if direct and name != "direct":
                added = (m["p50_us"] - direct["p50_us"]) / 1000
            cpu = m.get("cpu_util")
            rss = m.get("rss")
            out.append(
                f"| {entry['title']} | {name} | {_num(m['rps'])} | {_num(m['mb_s'], '{:,.1f}')} "
                f"| {_num(m['p50_us'] / 1000, '{:.3f}')} | {_num(m['p99_us'] / 1000, '{:.3f}')} "
                f"| {_num(added, '{:+.3f}')} | {_num(m.get('cpu_us_per_req'), '{:,.1f}')} "
                f"| {_num(None if cpu is None else cpu * 100, '{:.0f}')} "
                f"| {_num(None if rss is None else rss / MIB, '{:.0f}')} | {m['errors']} "
                f"| {_num(m.get('max_other_load'), '{:.2f}')} "
                f"| {_num(m.get('max_steal'), '{:.2f}')} |"
            )
    return [*out, ""]


def _memory(results: Json) -> list[str]:
    out: list[str] = []
    for entry in results["workloads"].values():
        driver = entry.get("driver")
        if driver == "sse":
            out += [
                f"## Memory: {entry['title']}",
                "",
                "RSS of the proxy's process tree before, with every stream open (max of 5 "
                "samples), and 1 s after they all ended.",
                "",
                "| target | streams complete | all open after s | RSS before MiB "
                "| RSS all open MiB | per stream KiB | RSS after MiB | proxy CPU s | errors "
                "| others |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
            ]
            for name, t in entry["targets"].items():
                r = t.get("result")
                if r is None:
                    out.append(f"| {name} | {t['status']} |||||||||")
                    continue
                mb = [None if r.get(k) is None else r[k] / MIB for k in ("rss_before",)]
                during = None if r.get("rss_during") is None else r["rss_during"] / MIB
                after = None if r.get("rss_after") is None else r["rss_after"] / MIB
                per = r.get("per_stream_bytes")
                out.append(
                    f"| {name} | {r['ok']}/{r['streams']} | {_num(r.get('all_open_s'), '{:.1f}')} "
                    f"| {_num(mb[0], '{:.1f}')} | {_num(during, '{:.1f}')} "
                    f"| {_num(None if per is None else per / 1024, '{:.1f}')} "
                    f"| {_num(after, '{:.1f}')} | {_num(r.get('cpu_s'), '{:.2f}')} "
                    f"| {r['errors'] or '-'} | {_num(r.get('other_load'), '{:.2f}')} |"
                )
            out.append("")
        elif driver == "slow":
            out += [
                f"## Memory: {entry['title']}",
                "",
                "One client with a 64 KiB receive buffer reading at a fixed pace; the upstream "
                "sends as fast as loopback allows. Peak RSS of the proxy's process tree "
                "(sampled every 50 ms) over its RSS just before.",
                "",
                "| target | complete | seconds | read MiB/s | RSS before MiB | peak RSS MiB "
                "| peak over baseline MiB | proxy CPU s | others |",
                "|---|---|---:|---:|---:|---:|---:|---:|---:|",
            ]
            for name, t in entry["targets"].items():
                r = t.get("result")
                if r is None:
                    out.append(f"| {name} | {t['status']} ||||||||")
                    continue
                before = r.get("rss_before")
                peak = r.get("rss_peak")
                over = r.get("peak_over_baseline")
                out.append(
                    f"| {name} | {'yes' if r['complete'] else 'NO'} (HTTP {r['status']}) "
                    f"| {r['seconds']:.1f} | {r['read_rate'] / MIB:.1f} "
                    f"| {_num(None if before is None else before / MIB, '{:.1f}')} "
                    f"| {_num(None if peak is None else peak / MIB, '{:.1f}')} "
                    f"| {_num(None if over is None else over / MIB, '{:.1f}')} "
                    f"| {_num(r.get('cpu_s'), '{:.2f}')} | {_num(r.get('other_load'), '{:.2f}')} |"
                )
            out.append("")
    return out


def _variants(results: Json) -> list[str]:
    """The default config beside one setting changed: the access log's cost on small
    requests, and the RL filter's skip_parse_without_mask_key on big bodies."""
    wl = results["workloads"]
    rows = []
    for name, entry in wl.items():
        gw = _med(entry, "gateway")
        for variant, what in (
            ("gateway-nolog", "access log off"),
            ("gateway-rl", "skip_parse_without_mask_key"),
        ):
            other = _med(entry, variant)
            if other is None or gw is None:
                continue
            base, theirs = _cpu(gw), _cpu(other)
            cost = base - theirs if base is not None and theirs is not None else None
            pct = None if cost is None or not base else 100 * cost / base
            ng = _med(entry, "nginx")
            vs_n = _ratio(other["rps"], ng["rps"] if ng else None)
            rows.append(
                f"| {name} | {what} | {_num(gw['rps'])} | {_num(other['rps'])} "
                f"| {_num(_cpu(gw), '{:.1f}')} | {_num(_cpu(other), '{:.1f}')} "
                f"| {_num(cost, '{:+.1f}')} | {_num(pct, '{:.0f}')} "
                f"| {_num(vs_n, '{:.2f}')} |"
            )
    if not rows:
        return []
    return [
        "## The default config beside one setting changed",
        "",
        "`gateway` is the default config (access log on, written to a file like a "
        "container's stdout). Difference: the default's proxy CPU per request minus the "
        "variant's; for the access log, that is what the log costs.",
        "",
        "| workload | variant | default req/s | variant req/s | default CPU us/req "
        "| variant CPU us/req | difference us/req | difference % of default | variant / nginx |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
    ]


def _floor(results: Json) -> list[str]:
    """Proxy CPU per request beside the parse of the same body alone (bench/floor.py)."""
    if results["meta"].get("gateway_skip_parse"):
        return []  # the gateway under test did not parse these bodies: no floor to compare
    floor = results.get("parse_floor") or {}
    rows = []
    for name, parse in floor.items():
        entry = results["workloads"].get(name)
        if entry is None:
            continue
        gw, rt = _cpu(_med(entry, "gateway")), _cpu(_med(entry, "sglang-router"))
        sj = parse["simdjson_us"]
        rest = None if gw is None else gw - sj
        rows.append(
            f"| {name} | {_num(sj, '{:,.1f}')} | {_num(parse['orjson_us'], '{:,.1f}')} "
            f"| {_num(gw, '{:,.1f}')} | {_num(rest, '{:+,.1f}')} | {_num(rt, '{:,.1f}')} |"
        )
    if not rows:
        return []
    return [
        "## The parse floor",
        "",
        "What parsing the body alone costs on the proxy's CPU (bench/floor.py): simdjson is "
        "the parser the gateway validates large bodies with, orjson is SGLang's. No "
        "validating proxy goes under its parser's figure; the gateway's proxy CPU per "
        "request minus it is the rest of its request path.",
        "",
        "| workload | simdjson parse us | orjson parse us | gateway CPU us/req "
        "| gateway minus simdjson parse | sglang-router CPU us/req |",
        "|---|---:|---:|---:|---:|---:|",
        *rows,
        "",
    ]


def _cpu(m: Json | None) -> float | None:
    if m is None:
        return None
    value = m.get("cpu_us_per_req")
    return None if value is None else float(value)


def _goal(results: Json) -> list[str]:
    """The request-path targets against this run: informational, never asserted."""
    wl = results["workloads"]
    rows: list[tuple[str, str, bool | None]] = []

    def ratio(name: str, target: str, other: str) -> float | None:
        if name not in wl:
            return None
        a, b = _med(wl[name], target), _med(wl[name], other)
        return _ratio(a["rps"] if a else None, b["rps"] if b else None)

    if "small" in wl:
        r = ratio("small", "gateway", "sglang-router")
        rows.append(
            ("small, 16 conns: gateway >= 1.0x sglang-router", _num(r, "{:.2f}x"), _ge(r, 1.0))
        )
        gw, rt = _med(wl["small"], "gateway"), _med(wl["small"], "sglang-router")
        g, t = _cpu(gw), _cpu(rt)
        shown = f"{_num(g, '{:.1f}')} vs {_num(t, '{:.1f}')} us"
        rows.append(("small: proxy CPU/request <= sglang-router's", shown, _le(g, t)))
        off = _cpu(_med(wl["small"], "gateway-nolog"))
        if g is not None and off is not None and g:
            share = (g - off) / g
            rows.append(
                (
                    "small: access log cost <= 10 % of the request's CPU",
                    f"{(g - off):+.1f} us ({share * 100:.0f} %)",
                    share <= 0.10,
                )
            )
    if "small-c1" in wl:
        e = wl["small-c1"]
        d, gw, rt = (_med(e, p) for p in ("direct", "gateway", "sglang-router"))
        ga = gw["p50_us"] - d["p50_us"] if gw and d else None
        ra = rt["p50_us"] - d["p50_us"] if rt and d else None
        shown = f"{_num(ga, '{:.0f}')} vs {_num(ra, '{:.0f}')} us"
        rows.append(("small, 1 conn: added p50 latency <= sglang-router's", shown, _le(ga, ra)))
    for name, target, bar in (
        ("resp-4mb", "gateway", 1.0),
        ("ids-100k", "gateway", 0.25),
        ("ids-100k-mask", "gateway", 0.25),
        ("ids-100k", "gateway-rl", 0.9),
        ("sse-200", "gateway", 1.2),
    ):
        r = ratio(name, target, "nginx")
        if name in wl:
            rows.append((f"{name}: {target} >= {bar}x nginx", _num(r, "{:.2f}x"), _ge(r, bar)))
    slow = wl.get("sse-slow")
    if slow:
        res = (slow["targets"].get("gateway") or {}).get("result") or {}
        per = res.get("per_stream_bytes")
        kib = None if per is None else per / 1024
        rows.append(
            ("slow SSE streams: <= 20 KiB per stream", _num(kib, "{:.1f} KiB"), _le(kib, 20.0))
        )
    if not rows:
        return []
    out = [
        "## Request-path targets (informational; nothing is asserted)",
        "",
        "| target | measured | met |",
        "|---|---:|---|",
    ]
    for what, shown, met in rows:
        out.append(f"| {what} | {shown} | {'-' if met is None else 'yes' if met else 'no'} |")
    return [*out, ""]


def _ge(v: float | None, bar: float) -> bool | None:
    return None if v is None else v >= bar


def _le(a: float | None, b: float | None) -> bool | None:
    return None if a is None or b is None else a <= b


def _scaling(results: Json) -> list[str]:
    sc = results.get("scaling")
    if not sc:
        return []
    if "skipped" in sc:
        return ["## Gateway scaling", "", f"Skipped: {sc['skipped']}.", ""]
    counts = sc["workers"]
    out = [
        f"## Gateway scaling (workers pinned to CPUs {sc['cpus']})",
        "",
        "| workload | " + " | ".join(f"{c} worker(s) req/s" for c in counts) + " | ratio |",
        "|---|" + "---:|" * (len(counts) + 1),
    ]
    for name, entry in sc["workloads"].items():
        meds = [_med(entry, f"gateway-x{c}") for c in counts]
        rps = [m["rps"] if m else None for m in meds]
        ratio = _ratio(rps[-1], rps[0])
        out.append(
            f"| {name} | " + " | ".join(_num(r) for r in rps) + f" | {_num(ratio, '{:.2f}x')} |"
        )
    return [*out, ""]


def _profile(results: Json) -> list[str]:
    prof = results.get("profile")
    if not prof:
        return []
    out = ["## Gateway profile (py-spy, % of samples)", ""]
    for name, p in prof.items():
        out += [
            f"### {name} ({p['samples']} samples, {_num(p.get('rps'))} req/s while sampled)",
            "",
            "| self % | frame |",
            "|---:|---|",
        ]
        out += [f"| {pct:.1f} | `{frame}` |" for frame, pct in p["self"]]
        out += ["", "| self % | source file |", "|---:|---|"]
        out += [f"| {pct:.1f} | `{frame}` |" for frame, pct in p.get("self_by_file", [])]
        out += ["", "| inclusive % | frame |", "|---:|---|"]
        out += [f"| {pct:.1f} | `{frame}` |" for frame, pct in p["inclusive"]]
        out.append("")
    return out


def markdown(results: Json) -> str:
    meta = results["meta"]
    v = meta["versions"]
    out = [
        f"# Gateway benchmark ({meta['mode']}, {meta['started']})",
        "",
        f"Command: `{meta['command']}`. Host: {meta['host']['cpus']} CPUs "
        f"({meta['host']['cpu_model']}), Linux {meta['host']['kernel']}, Python "
        f"{meta['host']['python']}. Pinning: proxy on CPU {meta['pinning']['proxy']}, "
        f"load generator and upstream on CPU {meta['pinning']['load_and_upstream']}. "
        f"{meta['rounds']} interleaved round(s) of {meta['duration_s']} s per target; "
        f"medians. Upstream: {meta.get('upstream', '?')}.",
        "",
        f"Versions: gateway {v['gateway_commit']} ({v.get('gateway_build', 'unknown')} build, "
        f"aiohttp {v['aiohttp']}, orjson "
        f"{v['orjson']}, uvloop {v['uvloop']}, {meta['gateway_workers']} worker(s)"
        f"{', skip_parse_without_mask_key' if meta.get('gateway_skip_parse') else ''}), nginx "
        f"{v['nginx'] or 'absent'} (client_body_buffer_size "
        f"{meta.get('nginx_body_buffer', '2m')}), sglang-router "
        f"{v['sglang_router'] or 'absent'}, wrk {v['wrk'] or 'absent'}.",
        "",
    ]
    out += _throughput(results)
    out += _goal(results)
    out += _variants(results)
    out += _floor(results)
    out += _absolute(results)
    out += _memory(results)
    out += _scaling(results)
    out += _profile(results)
    if results["notes"]:
        out += ["## Notes and skips", ""] + [f"- {n}" for n in results["notes"]] + [""]
    out.append(f"Elapsed: {meta.get('elapsed_s', '?')} s.")
    return "\n".join(out) + "\n"


# -- py-spy ---------------------------------------------------------------------------------


def collapse(raw: str, top: int = 25) -> Json:
    """Self and inclusive shares of each frame in py-spy's `--format raw` output."""
    self_c: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    by_file: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        total += n
        self_c[frames[-1]] += n
        leaf = frames[-1]
        by_file[leaf[leaf.rfind("(") + 1 :].split(":")[0].rstrip(")")] += n
        for f in set(frames):
            incl[f] += n
    if not total:
        return {"samples": 0, "self": [], "inclusive": [], "self_by_file": []}
    return {
        "samples": total,
        "self_by_file": [(f, 100 * c / total) for f, c in by_file.most_common(top)],
        "self": [(f, 100 * c / total) for f, c in self_c.most_common(top)],
        "inclusive": [(f, 100 * c / total) for f, c in incl.most_common(top)],
    }
