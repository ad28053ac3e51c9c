"""`sluice status` laid out for a terminal of a given width (and height): pure functions
from a `sluice.monitor.snapshot` to lines of rich `Text`.

The view, top to bottom: the header, one line per fact (run and version, gate, the
conservation equation, retirements, streams, the archive's backlog); the workers, one
line each (`sluice.status_cells`: full id, version, health, heartbeat age, then as many
of its role's cells as the width takes, most important first); the waits per hop
(p50 / p99); the admission leases. ``wide`` (`sluice status --wide`) shows every cell of
every worker, each worker's waits and leases and each consumer group's consumers.

Invariants, for any snapshot and any width >= `MIN_WIDTH`:

- no line is longer than ``width`` (terminal cells): the terminal never wraps a line,
  so each line on the screen is one line of the view. A fact or a worker that needs more
  room goes on onto continuation lines that this module indents itself;
- a worker id is never cut or shortened: the id column is as wide as the longest id (an
  id too long for it leaves its row's data to the next line; one longer than the whole
  width is split over lines, every character shown);
- with ``height``, the header and the workers come first and fit in it whenever the
  workers of each role can be folded to one line and a summary ("+ 14 more scorers ...",
  the unhealthy ones kept in view); the waits and the leases follow where they fit.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions
from rich.text import Text

from sluice.status_cells import (
    GROUPS_MOVED,
    RATE_WINDOW_S,
    ROLE_ORDER,
    Cell,
    alerts,
    cells,
    fmt_age,
    health,
    num,
    rate,
    role_of,
)

MIN_WIDTH = 40
"""Narrower terminals are laid out as this wide (and then wrap)."""

LABEL_W = 11
"""The header's label column ("consumers  "; continuation lines are indented by it)."""

GAP = "  "

HOPS = {"admission": "admission (gate)", "rollouts": "rollouts -> scorer",
        "scored": "scored -> {role}"}
"""Each hop's label, in the order a group passes them."""


def line(*parts: Cell) -> Text:
    return Text.assemble(*parts, no_wrap=True, overflow="crop")


def chunks(text: str, width: int) -> list[str]:
    """``text`` in pieces of at most ``width`` cells (every character kept)."""
    out, cur = [], ""
    for ch in text:
        if cur and cell_len(cur + ch) > width:
            out.append(cur)
            cur = ""
        cur += ch
    return [*out, cur] if cur or not out else out


def flow(first: list[Cell], parts: Sequence[Cell], width: int, indent: int) -> list[Text]:
    """``first`` (the start of the first line), then ``parts``, each after `GAP` and
    whole on a line: a part that would pass ``width`` starts a new line indented by
    ``indent``; one wider than a whole line is split over lines (never cut)."""
    indent = min(indent, width // 2)
    lines: list[list[Cell]] = [list(first)]
    used = sum(cell_len(t) for t, _ in first)
    fresh = not first  # nothing on the line yet that a part must be kept apart from

    def newline() -> None:
        nonlocal used, fresh
        lines.append([(" " * indent, "")])
        used, fresh = indent, True

    for text, style in parts:
        if not text:
            continue
        sep = "" if fresh else GAP
        if used + cell_len(sep + text) > width and used > indent:
            newline()
            sep = ""
        if used + cell_len(sep + text) <= width:
            lines[-1] += [(sep, ""), (text, style)]
            used, fresh = used + cell_len(sep + text), False
            continue
        if sep:
            lines[-1].append((sep, ""))
            used += cell_len(sep)
        rest = text  # wider than a whole line: split, at a space where there is one
        while rest:
            piece = chunks(rest, max(width - used, 1))[0]
            if len(piece) < len(rest) and " " in piece.strip():
                piece = piece[:piece.rstrip().rindex(" ") + 1]
            lines[-1].append((piece.rstrip() if len(piece) < len(rest) else piece, style))
            used, fresh, rest = used + cell_len(piece), False, rest[len(piece):]
            if rest:
                newline()
    return [line(*c) for c in lines]


def fact(label: str, parts: Sequence[Cell], width: int) -> list[Text]:
    """One header fact: ``label`` in the label column, then its parts (`flow`)."""
    return flow([(label.ljust(LABEL_W - len(GAP)), "bold")], parts, width, LABEL_W)


def header(snap: dict[str, Any], width: int, window: int | None,
           run: str | None) -> list[Text]:
    st, c = snap.get("state", {}), snap["conservation"]
    trainer = next((w for wid, w in sorted(snap.get("workers", {}).items())
                    if role_of(wid) == "trainer" and not w.get("exited")), None)
    head: list[Cell] = [(f"version {st.get('version', '-')}", "bold")]
    if trainer is not None:
        head.append((f"trainer step {trainer.get('step', '-')} of "
                     f"{trainer.get('max_steps', '-')}", ""))
    out = fact("run", [(run, "bold"), *head] if run else head, width)
    if window is not None:
        held = int(num(c.get("cursor"))) - int(num(c.get("retired")))
        gate = ("open", "green") if held < window else ("CLOSED", "bold yellow")
        out += fact("gate", [gate, (f"{held} in flight of window {window}", "")], width)
    in_flight = c.get("in_flight")
    books: list[Cell] = [
        (f"cursor {c.get('cursor')} == retired {c.get('retired')} + in_flight "
         f"{'unknown' if in_flight is None else in_flight}", ""),
        (f"(generating {c.get('generating', 0)})", ""),
        ("balanced", "green") if c.get("balanced") else ("NOT balanced", "bold red")]
    out += fact("books", books, width)
    retired = [(f"{r} {n}", "") for r, n in (c.get("by_reason") or {}).items()]
    if c.get("undecodable"):
        retired.append((f"(undecodable {c['undecodable']}, apart)", "red"))
    out += fact("retired", retired or [("0", "")], width)
    return out + fact("streams", stream_parts(snap), width) + archive(snap, width)


def stream_parts(snap: dict[str, Any]) -> list[Cell]:
    lengths, groups = snap.get("lengths", {}), snap.get("groups", {})
    parts: list[Cell] = []
    for name in ("rollouts", "scored", "control", "dlq"):
        n = lengths.get(name)
        n = n if isinstance(n, int) else "?"
        g = next((gi for gn, gi in groups.items()
                  if gn.startswith(name + "/") and not gn.endswith("/archivers")), None)
        text = f"{name} {n}" + (f" (lag {g.get('lag')}, pending {g.get('pending')})"
                                if g is not None else "")
        parts.append((text, "bold red" if name == "dlq" and n not in (0, "?") else ""))
    return parts


def archive(snap: dict[str, Any], width: int) -> list[Text]:
    arch = snap.get("groups", {}).get("scored/archivers")
    if arch is None:
        return []
    backlog = int(num(arch.get("lag"))) + int(num(arch.get("pending")))
    return fact("archive", [(f"backlog {backlog} (lag {arch.get('lag')}, pending "
                             f"{arch.get('pending')}: the archivers group)", "")], width)


def _pending(snap: dict[str, Any]) -> dict[str, int]:
    """Consumer name -> entries pending on it (both pipeline groups)."""
    out: dict[str, int] = {}
    for gname, gi in snap.get("groups", {}).items():
        for c in gi.get("consumers", []):
            out[f"{gname.split('/')[0]}:{c.get('name')}"] = int(num(c.get("pending")))
    return out


def _order(wid: str) -> tuple[Any, ...]:
    """Roles in `ROLE_ORDER`, then ids in natural order (scorer-2 before scorer-10)."""
    r = role_of(wid)
    return (ROLE_ORDER.index(r) if r in ROLE_ORDER else len(ROLE_ORDER),
            *((0, int(x)) if x.isdigit() else (1, x) for x in re.split(r"(\d+)", wid)))


def fold(rows: dict[str, list[str]], budget: int, bad: set[str]) -> dict[str, list[str]]:
    """The workers of each role to show on at most ``budget`` lines, counting one summary
    line per role shown in part: the role with the most rows shown gives one up until
    they fit or every role is down to one (unhealthy ones, ``bad``, are kept first)."""
    shown = {r: sorted(ids, key=lambda w: (w not in bad, _order(w))) for r, ids in rows.items()}

    def cost() -> int:
        return sum(len(s) + (len(s) < len(rows[r])) for r, s in shown.items())

    while cost() > budget:
        r = max(shown, key=lambda r: len(shown[r]))
        if len(shown[r]) <= 1:
            break
        shown[r] = shown[r][:-1]
    return {r: sorted(s, key=_order) for r, s in shown.items()}


def workers(snap: dict[str, Any], width: int, *, wide: bool = False,
            heartbeat_s: float | None = None, earlier: dict[str, dict[str, Any]] | None = None,
            max_lines: int | None = None) -> list[Text]:
    """The workers table (module docstring); ``max_lines`` folds roles (`fold`)."""
    now, ws, earlier = snap["t"], snap.get("workers", {}), earlier or {}
    if not ws:
        return [line(("workers   none", "bold"))]
    pend = _pending(snap)
    ids = sorted(ws, key=_order)
    ver = {wid: str(ws[wid].get("version", "-")) for wid in ids}
    w_id = max(len("worker"), *(cell_len(i) for i in ids))
    w_ver = max(3, *(cell_len(v) for v in ver.values()))
    fixed = w_id + w_ver + 6 + 6 + 3 * len(GAP)
    long_ids = fixed + len(GAP) + 12 > width  # ids too long to leave room for data
    if long_ids:  # the id on a line of its own, the row's data indented below it
        fixed += 2 - w_id - len(GAP)
    rows: dict[str, list[str]] = {}
    for wid in ids:
        rows.setdefault(role_of(wid), []).append(wid)
    basis = (f"rates over the last {RATE_WINDOW_S:.0f}s" if any(w in earlier for w in ids)
             else "rates since each worker started")
    title = ("worker".ljust(w_id) + GAP if not long_ids else "  ") + "ver".rjust(w_ver) \
        + GAP + "health" + GAP + "age".rjust(6)
    out = [line(("worker (its data on the line below)", "bold"))] if long_ids else []
    out.append(line((title, "bold"), *([(GAP + basis, "dim")]
                                       if cell_len(title + GAP + basis) <= width else [])))
    hb = {wid: health(ws[wid], now, heartbeat_s) for wid in ids}
    shown = rows if wide or max_lines is None else fold(
        rows, max((max_lines - len(out)) // (2 if long_ids else 1), 1),
        {wid for wid in ids if hb[wid][0] != "ok"})
    for role, wids in rows.items():
        own = {wid: cells(wid, ws[wid], earlier.get(wid), pend.get(
            f"{'rollouts' if role == 'scorer' else 'scored'}:{wid.split('/', 1)[-1]}"))
            for wid in wids}
        keep = [i for i in range(len(own[wids[0]][0]))  # columns empty in every row go
                if any(own[w][0][i][0] for w in wids)]
        own = {w: ([own[w][0][i] for i in keep], own[w][1]) for w in wids}
        cols = [max(cell_len(own[w][0][i][0]) for w in wids) for i in range(len(keep))]
        alert_w = max((cell_len(GAP.join(t for t, _ in alerts(ws[w]))) + len(GAP)
                       for w in wids if alerts(ws[w])), default=0)
        k, used = 0, fixed + alert_w
        while k < len(cols) and (wide or used + len(GAP) + cols[k] <= width):
            used += len(GAP) + cols[k]
            k += 1
        for wid in shown[role]:
            lead: list[Cell] = []
            if long_ids:
                out += [line((piece, "bold")) for piece in chunks(wid, width)]
                lead.append(("  ", ""))
            else:
                lead.append((wid.ljust(w_id) + GAP, "bold"))
            age = now - num(ws[wid].get("t"), now)
            lead += [(ver[wid].rjust(w_ver) + GAP, ""), (hb[wid][0].ljust(6), hb[wid][1]),
                     (GAP + fmt_age(age).rjust(6), "yellow" if hb[wid][0] == "late" else "")]
            row = [(t.ljust(cols[i]) if i < k - 1 else t, s)
                   for i, (t, s) in enumerate(own[wid][0][:k])]
            extra = alerts(ws[wid]) + (own[wid][1] if wide else [])
            out += flow(lead, row + extra, width, 4)
        hidden = [w for w in wids if w not in shown[role]]
        if hidden:
            out.append(summary(role, hidden, ws, hb, earlier, width))
    return out


def summary(role: str, hidden: list[str], ws: dict[str, Any], hb: dict[str, Cell],
            earlier: dict[str, dict[str, Any]], width: int) -> Text:
    """The line that stands for a role's folded workers: how many, their health, their
    groups/s together (roles that move groups)."""
    counts: dict[str, int] = {}
    for w in hidden:
        counts[hb[w][0]] = counts.get(hb[w][0], 0) + 1
    parts = [", ".join(f"{n} {h}" for h, n in counts.items())]
    count = GROUPS_MOVED.get(role)
    if count is not None:
        total = sum(rate(ws[w], earlier.get(w), count)[0] or 0.0 for w in hidden)
        parts.append(f"{total:.1f} grp/s together")
    text = (f"+ {len(hidden)} more {role}{'s' if len(hidden) > 1 else ''} ("
            + "; ".join([*parts, "--wide lists them"]) + ")")
    return line((text if cell_len(text) <= width else text.split(" (")[0], "dim"))


def waits(snap: dict[str, Any], width: int, wide: bool = False) -> list[Text]:
    """p50 / p99 of each hop (each worker's last 2,048 waits, from its heartbeat): one
    line per hop, the worst worker's figures (and, where the width allows, which);
    ``wide``: one line per worker and hop."""
    per: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for wid, w in sorted(snap.get("workers", {}).items(), key=lambda x: _order(x[0])):
        if w.get("exited"):
            continue
        for hop, q in sorted((w.get("waits") or {}).items()):
            label = HOPS.get(hop, hop).format(role=role_of(wid))
            per.setdefault(label, []).append((wid, q))
    if not per:
        return []
    order = [h.format(role=r) for h in HOPS.values() for r in ("trainer", "archiver")]
    per = dict(sorted(per.items(), key=lambda x: order.index(x[0]) if x[0] in order
                      else len(order)))
    w_hop = max(cell_len(h) for h in per)
    out = fact("waits", [("p50 / p99 of each worker's last 2048", "dim"),
                         ("(per hop: the worst worker's)" if not wide else "", "dim")], width)
    for hop, rows in per.items():
        rows = rows if wide else [max(rows, key=lambda r: num(r[1].get("p99")))]
        for wid, q in rows:
            head = [(" " * LABEL_W + hop.ljust(w_hop), "")]
            figs = [(f"p50 {num(q.get('p50')):.3f}s", ""), (f"p99 {num(q.get('p99')):.3f}s", "")]
            n_workers = len(per[hop])
            who = (f"{wid} (n {q.get('n')})" if wide or n_workers == 1
                   else f"{wid}, worst of {n_workers}")
            got = flow(head, [*figs, (who, "dim")], width, LABEL_W + 2)
            out += got if wide or len(got) == 1 else flow(head, figs, width, LABEL_W + 2)
    return out


def leases(snap: dict[str, Any], width: int, wide: bool = False) -> list[Text]:
    """The admission leases: per owner, how many it holds and when its oldest expires
    (negative: expired, waiting for a takeover) on one line when it fits (else the
    total and the oldest), every owner with ``wide``."""
    rows = snap.get("leases") or {}
    if not rows:
        return fact("leases", [("none held", "dim")], width)

    def left(x: float | None) -> Cell:
        return ("-", "") if x is None else (f"in {x:.1f}s", "") if x >= 0 else \
            (f"EXPIRED {-x:.1f}s ago", "bold red")

    parts = []
    for owner, r in rows.items():
        t, s = left(r.get("oldest_deadline_s"))
        parts.append((f"{owner} {r.get('count')} (oldest expires {t})".replace(
            "expires EXPIRED", "EXPIRED"), s))
    got = fact("leases", parts, width)
    if wide or len(got) == 1:
        return got
    known = [(o, r["oldest_deadline_s"]) for o, r in rows.items()
             if r.get("oldest_deadline_s") is not None]
    total = sum(int(num(r.get("count"))) for r in rows.values())
    head: list[Cell] = [(f"{total} held by {len(rows)} generators", "")]
    if known:
        owner, x = min(known, key=lambda z: z[1])
        t, s = left(x)
        head += [(f"the oldest {'expires ' if x >= 0 else ''}{t}", s), (f"({owner})", "")]
    return fact("leases", head, width)


def consumers(snap: dict[str, Any], width: int) -> list[Text]:
    """`--wide`: each consumer group's consumers (pending, idle), heartbeat or not."""
    out = []
    for gname, gi in snap.get("groups", {}).items():
        if gi.get("consumers"):
            out += fact("consumers", [(gname, "bold")] + [
                (f"{c.get('name')} ({c.get('pending')}, {num(c.get('idle')) / 1000:.1f}s idle)",
                 "") for c in gi["consumers"]], width)
    return out


def status_lines(snap: dict[str, Any], width: int, *, height: int | None = None,
                 wide: bool = False, window: int | None = None,
                 heartbeat_s: float | None = None, run: str | None = None,
                 earlier: dict[str, dict[str, Any]] | None = None) -> list[Text]:
    """The whole view (module docstring) for a terminal ``width`` x ``height`` (None: no
    height limit, e.g. output to a file); ``earlier``: `status_cells.earlier_beats`."""
    width = max(width, MIN_WIDTH)
    top = header(snap, width, window, run)
    room = None if height is None or wide else max(height - len(top) - 1, 2)
    out = [*top, line(("", "")),
           *workers(snap, width, wide=wide, heartbeat_s=heartbeat_s, earlier=earlier,
                    max_lines=room)]
    for section in (waits(snap, width, wide), leases(snap, width, wide),
                    consumers(snap, width) if wide else []):
        if section and (height is None or wide or len(out) + 1 + len(section) <= height):
            out += [line(("", "")), *section]
    return out


def plain(lines: Sequence[Text]) -> list[str]:
    """The lines as plain text (what tests and pipes read)."""
    return [t.plain for t in lines]


@dataclass
class StatusView:
    """A rich renderable of `status_lines`, laid out when it is rendered: for the
    console's width then (a ``--watch`` follows a resized terminal), and with
    ``fit_height`` for its height less one line (the prompt after a one-shot look, the
    cursor under a live one)."""

    snap: dict[str, Any]
    window: int | None = None
    heartbeat_s: float | None = None
    run: str | None = None
    wide: bool = False
    earlier: dict[str, dict[str, Any]] | None = None
    fit_height: bool = False

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[Text]:
        height = max(console.size.height - 1, 1) if self.fit_height else None
        yield from status_lines(self.snap, options.max_width, height=height, wide=self.wide,
                                window=self.window, heartbeat_s=self.heartbeat_s,
                                run=self.run, earlier=self.earlier)
