#!/usr/bin/env python3
"""check-rooms.py - fails when the sources' modules call each other in a circle or a room reaches above itself.

The graph is derived from the sources, not written by hand:
  - a module is one .c/.h pair of a room (gateway/front.c + gateway/front.h = gateway/front);
  - its symbols are what ctags finds defined in it and visible to others: non-static functions and variables of
    the .c, function-like macros and static inline functions of the .h;
  - module A "calls" module B when an identifier of B's symbols appears in A's code (comments and strings
    stripped), so a call through a name, a macro use and taking a function's address all count;
  - module A "includes" B when A's .c or .h has #include "B.h";
  - a room's internal.h (conf/internal.h) is no module: it holds what the room's files share. A file that uses one
    of its macros is charged with what the macro's body names, and the names it declares count only inside its
    room (nothing outside includes it, rule 4), so a same-named identifier elsewhere is something else.

Rules checked:
  1. rooms in this order, lowest first: common, conf, {store, upstream}, gateway. A module may call or include
     only modules of its own room or a lower one (store and upstream never reach each other);
  2. inside a room, no circle: no two modules reach each other through calls, directly or around a loop;
  3. where ORDER below lists a room's modules, a module reaches only modules listed after it (the room's
     intended layering, highest first);
  4. a room's internal.h is included only by files of that room.

  scripts/check-rooms.py            check; prints every violation and exits 1 if there is one
  scripts/check-rooms.py --graph    also print the module graph (A -> B, C)
  scripts/check-rooms.py --room R   only the violations of modules of room R (a test per room that is clean)
"""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANK = {"common": 0, "conf": 1, "store": 2, "upstream": 2, "gateway": 3}

# The intended layering inside a room, highest first: a module may reach only those after it. A room without an
# entry is checked for circles only.
ORDER = {
    "store": ["store/store", "store/admin", "store/cleaner", "store/sweeper", "store/owner", "store/claim", "store/ops",
              "store/ledger", "store/migrate", "store/notify", "store/order", "store/redis", "store/pg", "store/cancel"],
    "conf": ["conf/reference", "conf/identity", "conf/conf", "conf/restart", "conf/check", "conf/routes",
             "conf/upstreams", "conf/process", "conf/idempotency", "conf/fields", "conf/types"],
    "upstream": ["upstream/upstream", "upstream/curl", "upstream/h1", "upstream/head", "upstream/transfer", "upstream/trace",
                 "upstream/types"],
    "gateway": [
        "gateway/main", "gateway/cli_keys", "gateway/reconcile", "gateway/admin", "gateway/adminkeys", "gateway/front", "gateway/loop", "gateway/pipeline", "gateway/probe",
        "gateway/cache", "gateway/ctx", "gateway/reload", "gateway/ordering", "gateway/problem", "gateway/access", "gateway/spans", "gateway/gateway",
        "gateway/idem", "gateway/parts", "gateway/jwt", "gateway/json", "gateway/status", "gateway/conntrack",
        "gateway/answer", "gateway/owned", "gateway/hints", "gateway/verify", "gateway/tls",
    ],
}


def module_of(path):
    d, f = os.path.split(path)
    return d + "/" + os.path.splitext(f)[0]


def strip_code(text):
    """Removes comments, string and character literals, so only code identifiers remain."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "/" and i + 1 < n and text[i + 1] == "*":
            j = text.find("*/", i + 2)
            i = n if j < 0 else j + 2
            out.append(" ")
        elif c == "/" and i + 1 < n and text[i + 1] == "/":
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            i = j + 1
            out.append(" ")
        else:
            out.append(c)
            i += 1
    return "".join(out)


def sources():
    files = []
    for room in RANK:
        d = os.path.join(ROOT, room)
        if not os.path.isdir(d):
            continue
        for f in sorted(os.listdir(d)):
            if f.endswith((".c", ".h")):
                files.append(room + "/" + f)
    return files


def is_internal(path):
    return os.path.basename(path) == "internal.h"


def internal_headers(files):
    """room -> (macro name -> identifiers its body names, every identifier the header names) of its internal.h."""
    out = {}
    for f in files:
        if not is_internal(f):
            continue
        with open(os.path.join(ROOT, f), encoding="utf-8", errors="replace") as fh:
            text = strip_code(fh.read().replace("\\\n", " "))
        macros = {}
        for m in re.finditer(r"^\s*#\s*define\s+(\w+)(.*)$", text, re.M):
            macros[m.group(1)] = set(re.findall(r"\b[A-Za-z_]\w*\b", m.group(2)))
        out[f.split("/")[0]] = (macros, set(re.findall(r"\b[A-Za-z_]\w*\b", text)))
    return out


def ctags_symbols(files):
    """module -> set of names other modules can use."""
    out = subprocess.run(
        ["ctags", "-x", "--c-kinds=fvd", "--language-force=C"] + files,
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout
    syms = {}
    for line in out.splitlines():
        m = re.match(r"(\S+)\s+(\S+)\s+(\d+)\s+(\S+)\s+(.*)$", line)
        if not m:
            continue
        name, kind, _, path, sig = m.groups()
        mod = module_of(path)
        if path.endswith(".c"):
            if kind not in ("function", "variable") or re.match(r"\s*static\b", sig):
                continue
        else:
            if kind == "macro":
                if not re.match(r"#\s*define\s+\w+\(", sig):
                    continue  # object-like macros are constants, not calls
            elif kind == "function":
                if "inline" not in sig:
                    continue
            else:
                continue
        syms.setdefault(mod, set()).add(name)
    return syms


def main():
    args = sys.argv[1:]
    graph_out = "--graph" in args
    only = args[args.index("--room") + 1] if "--room" in args and args.index("--room") + 1 < len(args) else None
    files = sources()
    internal = internal_headers(files)
    syms = ctags_symbols([f for f in files if not is_internal(f)])
    owner = {}
    for mod, names in syms.items():
        for s in names:
            owner.setdefault(s, set()).add(mod)
    calls, incs, bad = {}, {}, []
    room = lambda m: m.split("/")[0]
    for f in files:
        if is_internal(f):
            continue
        mod = module_of(f)
        with open(os.path.join(ROOT, f), encoding="utf-8", errors="replace") as fh:
            text = fh.read()
        idents = set(re.findall(r"\b[A-Za-z_]\w*\b", strip_code(text)))
        for inc in re.findall(r'^\s*#\s*include\s+"([^"]+)"', text, re.M):
            if is_internal(inc):
                if room(inc) != room(mod):
                    bad.append(f"{f} includes {inc}: the internal header of another room")
                macros, seen = internal.get(room(inc), ({}, set()))[0], set()
                while idents & set(macros) - seen:  # a macro's body may use another macro
                    for ident in idents & set(macros) - seen:
                        seen.add(ident)
                        idents = idents | macros[ident]
            elif inc.split("/")[0] in RANK:
                t = module_of(inc)
                if t != mod:
                    incs.setdefault(mod, set()).add(t)
        for ident in idents:
            for t in owner.get(ident, ()):
                if t != mod and (room(t) == room(mod) or ident not in internal.get(room(t), ({}, set()))[1]):
                    calls.setdefault(mod, {}).setdefault(t, set()).add(ident)

    for kind, edges in (("calls", {a: set(b) for a, b in calls.items()}), ("includes", incs)):
        for a, targets in sorted(edges.items()):
            for b in sorted(targets):
                ra, rb = room(a), room(b)
                if ra != rb and RANK[rb] >= RANK[ra]:
                    why = "a peer room" if RANK[rb] == RANK[ra] else "a higher room"
                    bad.append(f"{a} {kind} {b}: {why} ({ra} may reach only rooms below it)")
                order = ORDER.get(ra)
                if ra == rb and order and a in order and b in order and order.index(b) <= order.index(a):
                    bad.append(f"{a} {kind} {b}: against the layering of {ra}/ (check-rooms.py ORDER)")

    # Circles: strongly connected components of the call graph (Tarjan, iterative).
    nodes = sorted(set(calls) | {b for t in calls.values() for b in t})
    index, low, on, stack, comps, counter = {}, {}, set(), [], [], [0]
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(calls.get(root, {}))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(calls.get(w, {})))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    comps.append(sorted(comp))
    for comp in comps:
        members = set(comp)
        detail = []
        for a in comp:
            for b in sorted(set(calls.get(a, {})) & members):
                detail.append(f"    {a} -> {b} ({', '.join(sorted(calls[a][b])[:4])})")
        bad.append("circle: " + " <-> ".join(comp) + "\n" + "\n".join(detail))

    if only:
        bad = [b for b in bad if b.startswith((f"{only}/", f"circle: {only}/"))]
    if graph_out:
        for a in sorted(calls):
            print(f"{a} -> {', '.join(sorted(calls[a]))}")
    for b in bad:
        print("check-rooms: " + b)
    print(f"check-rooms: {len(nodes)} modules, {sum(len(t) for t in calls.values())} call edges, "
          f"{len(bad)} violation{'s' if len(bad) != 1 else ''}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
