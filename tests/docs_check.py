#!/usr/bin/env python3
"""docs_check.py - the user documentation stands alone and its links work.

Checks README.md, CHANGELOG.md and docs/*.md of the source tree given as the first argument:
  - every relative link ([text](path) or [text](path#anchor)) names a file of the tree, and every anchor a
    heading of that file (GitHub's slugs: lower case, punctuation dropped, spaces to '-');
  - no document sends the reader to a file a user does not have (SPEC.md, ../shared, "the contract") or to a
    commit (a backquoted hexadecimal commit id): history is in git;
  - README.md stays short (at most 300 lines);
  - CHANGELOG.md (Keep a Changelog) has an Unreleased section and a section for meson.build's project version;
  - every problem type the sources answer (a status then a name, "409, \"name\"", or a name given to a *refuse* or
    *problem* function) is in docs/http.md, and every name in its table of problems is one the sources answer;
  - every metric common/metrics.c exposes, and every value of its outcome label, is in docs/operations.md (the outcome table);
  - every IDEMGATE_* environment variable the gateway reads is in docs/configuration.md;
  - every module (a .c file of common, conf, store, upstream, gateway) has its row in docs/ARCHITECTURE.md.
Prints each problem as FILE:LINE: what, and exits 1 if there is one.
"""
import os
import re
import sys

README_MAX_LINES = 300
FORBIDDEN = [
    (re.compile(r"SPEC\.md|\bSPEC\s*(§|\d)|\bthe SPEC\b"), "refers to the SPEC, which a user does not have"),
    (re.compile(r"\.\./shared|shared folder"), "refers to ../shared, which a user does not have"),
    (re.compile(r"\bthe contract\b", re.I), "refers to 'the contract'"),
    (re.compile(r"`(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,12}`"), "names a commit (history belongs in git)"),
]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading):
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)  # keeps letters, digits, '_', '-' and spaces (GitHub's rule)
    return s.replace(" ", "-")


def anchors(path, cache={}):
    if path not in cache:
        found, fence = set(), False
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.startswith("```"):
                    fence = not fence
                m = None if fence else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
                if m:
                    found.add(slug(re.sub(r"[`*]", "", m.group(1))))
        cache[path] = found
    return cache[path]


def changelog_problems(root):
    with open(os.path.join(root, "meson.build"), encoding="utf-8") as f:
        m = re.search(r"project\([^)]*?version\s*:\s*'([^']+)'", f.read(), re.S)
    if not m:
        return ["meson.build: no project version"]
    with open(os.path.join(root, "CHANGELOG.md"), encoding="utf-8") as f:
        heads = re.findall(r"^## \[([^\]]+)\]", f.read(), re.M)
    out = []
    if "Unreleased" not in heads:
        out.append("CHANGELOG.md: no '## [Unreleased]' section")
    if m.group(1) not in heads:
        out.append(f"CHANGELOG.md: no '## [{m.group(1)}]' section for meson.build's version {m.group(1)}")
    return out


KEBAB = r'"([a-z]+(?:-[a-z]+)+)"'
PROBLEM_IN_CODE = [re.compile(r"\b[1-5][0-9]{2},\s*" + r'"([a-z]+(?:-[a-z]+)*)"'),
                   re.compile(r"\b\w*(?:refuse|problem)\w*\(\s*[\w>.-]+,\s*" + KEBAB)]


def problem_problems(root):
    names = set()
    for room in ("gateway", "store", "upstream", "common"):
        d = os.path.join(root, room)
        for n in sorted(os.listdir(d)):
            if n.endswith(".c"):
                with open(os.path.join(d, n), encoding="utf-8") as f:
                    code = f.read()
                for pat in PROBLEM_IN_CODE:
                    names.update(pat.findall(code))
    with open(os.path.join(root, "docs", "http.md"), encoding="utf-8") as f:
        http = f.read()
    out = [f"docs/http.md: the problem type '{n}' the gateway answers is not documented" for n in sorted(names)
           if f"`{n}`" not in http]
    table = re.search(r"^## Every problem the gateway answers\n(.*?)^## ", http, re.S | re.M)
    if not table:
        return out + ["docs/http.md: no '## Every problem the gateway answers' section"]
    for n in re.findall(r"^\| `([a-z-]+)` \|", table.group(1), re.M):
        if n not in names:
            out.append(f"docs/http.md: the table names '{n}', which no source answers")
    if len(names) < 20:
        out.append(f"docs_check: only {len(names)} problem types found in the sources: the patterns went stale")
    return out


def metric_problems(root):
    with open(os.path.join(root, "common", "metrics.c"), encoding="utf-8") as f:
        code = f.read()
    names = set(re.findall(r'"(idemgate_[a-z_]+)"', code))
    block = re.search(r"outcome_names\[[^]]*\] = \{(.*?)\};", code, re.S)
    outcomes = re.findall(r'= "([a-z_]+)"', block.group(1)) if block else []
    with open(os.path.join(root, "docs", "operations.md"), encoding="utf-8") as f:
        ops = f.read()
    out = [f"docs/operations.md: the metric {n} is not in the metrics table" for n in sorted(names)
           if f"`{n}" not in ops]
    # the outcome table: its rows' first cells, after "`outcome` takes exactly these values"
    table = re.search(r"`outcome` takes exactly these values.*?\n\n(\|.*?)\n\n", ops, re.S)
    listed = set(re.findall(r"^\| `([a-z_]+)` \|", table.group(1), re.M)) if table else set()
    out += [f"docs/operations.md: the outcome label '{o}' is not in the list of outcome values" for o in outcomes
            if o not in listed]
    out += [f"docs/operations.md: lists the outcome '{o}', which common/metrics.c does not have" for o in
            sorted(listed - set(outcomes))]
    if len(outcomes) < 10:
        out.append("docs_check: the outcome names of common/metrics.c were not found: the pattern went stale")
    if len(names) < 15:
        out.append(f"docs_check: only {len(names)} metrics found in common/metrics.c: the pattern went stale")
    return out


def env_problems(root):
    names = set()
    for room in ("gateway", "conf", "store", "upstream", "common"):
        d = os.path.join(root, room)
        for n in sorted(os.listdir(d)):
            if n.endswith(".c"):
                with open(os.path.join(d, n), encoding="utf-8") as f:
                    names.update(re.findall(r'getenv\("(IDEMGATE_[A-Z_]+)"\)', f.read()))
    with open(os.path.join(root, "docs", "configuration.md"), encoding="utf-8") as f:
        conf = f.read()
    return [f"docs/configuration.md: the environment variable {n} the gateway reads is not documented"
            for n in sorted(names) if f"`{n}`" not in conf]


def module_problems(root):
    with open(os.path.join(root, "docs", "ARCHITECTURE.md"), encoding="utf-8") as f:
        arch = f.read()
    out = []
    for room in ("common", "conf", "store", "upstream", "gateway"):
        for n in sorted(os.listdir(os.path.join(root, room))):
            if n.endswith(".c") and f"| `{room}/{n[:-2]}` |" not in arch:
                out.append(f"docs/ARCHITECTURE.md: the module {room}/{n[:-2]} has no row in the table of rooms")
    return out


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")
    docs = ["README.md", "CHANGELOG.md"] + sorted(
        os.path.join("docs", n) for n in os.listdir(os.path.join(root, "docs")) if n.endswith(".md"))
    problems = []
    for rel in docs:
        path = os.path.join(root, rel)
        if not os.path.exists(path):
            problems.append(f"{rel}: missing")
            continue
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
        if rel == "README.md" and len(lines) - 1 > README_MAX_LINES:
            problems.append(f"{rel}: {len(lines) - 1} lines, more than {README_MAX_LINES}: move detail to docs/")
        fence = False
        for no, line in enumerate(lines, 1):
            if line.startswith("```"):
                fence = not fence
            for pat, why in FORBIDDEN:
                if pat.search(line):
                    problems.append(f"{rel}:{no}: {why}: {line.strip()[:100]}")
            if fence:
                continue
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                    continue
                file_part, _, anchor = target.partition("#")
                dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
                if not os.path.exists(dest):
                    problems.append(f"{rel}:{no}: link to a missing file: {target}")
                elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
                    problems.append(f"{rel}:{no}: link to a missing heading: {target}")
    problems += changelog_problems(root)
    problems += problem_problems(root)
    problems += metric_problems(root)
    problems += env_problems(root)
    problems += module_problems(root)
    for p in problems:
        print(p)
    print(f"docs_check: {len(docs)} documents, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
