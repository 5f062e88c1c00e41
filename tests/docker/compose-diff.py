#!/usr/bin/python3
"""compose-diff.py - checks that docker/compose.test.yaml (the test stage's override) changes only images and
network of docker/compose.yaml, and that compose.yaml is what a normal Docker user can run: official postgres
and redis images, the gateway built on debian:bookworm-slim, a bridge network with published ports, no host
network. Ends with `compose: N passed, N failed`; exits 1 on a failure.

    tests/docker/compose-diff.py [BASE OVERRIDE]     (default docker/compose.yaml docker/compose.test.yaml)
"""
import os
import sys

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NETWORK_KEYS = {"network_mode", "networks", "extra_hosts"}
passed = failed = 0


def check(name, ok):
    global passed, failed
    if ok:
        passed += 1
        print("  ok   " + name)
    else:
        failed += 1
        print("  FAIL " + name)


def load(path):
    with open(path, encoding="utf-8") as f:
        doc = yaml.safe_load(f)  # SafeLoader resolves the << merge keys, as compose does
    return {k: v for k, v in doc.items() if not k.startswith("x-")}


def differences(base, over):
    """The override's settings that are neither an image nor a network (a list of 'service.key' strings)."""
    out = [k for k in over if k != "services"]
    for name, svc in (over.get("services") or {}).items():
        orig = (base.get("services") or {}).get(name)
        if orig is None:
            out.append(name + " (a service compose.yaml does not have)")
            continue
        for key, val in svc.items():
            if key == "image" or key in NETWORK_KEYS:
                continue
            if key == "build":
                if "build" not in orig and "image" in orig:
                    continue  # an official image replaced by a local build of a stand-in: the image
                extra = sorted(set(val) - {"network"}) if isinstance(val, dict) else ["build"]
                out += ["%s.build.%s" % (name, k) for k in extra]
                continue
            out.append("%s.%s" % (name, key))
    return out


def main(argv):
    base_path = argv[1] if len(argv) > 2 else os.path.join(ROOT, "docker/compose.yaml")
    over_path = argv[2] if len(argv) > 2 else os.path.join(ROOT, "docker/compose.test.yaml")
    base = load(base_path)
    try:
        over = load(over_path)
    except OSError as e:
        check("the test override %s loads (%s)" % (over_path, e.strerror), False)
        over = {}
    svcs = base.get("services") or {}
    diff = differences(base, over)
    check("compose.test.yaml differs from compose.yaml only in images and network (else: %s)"
          % (", ".join(diff) or "none"), over != {} and not diff)
    check("compose.test.yaml changes the network of every service (%s)" % ", ".join(sorted(svcs)),
          over != {} and all(over["services"].get(n, {}).get("network_mode") == "host" for n in svcs))
    for name, official in (("postgres", "postgres:"), ("redis", "redis:")):
        svc = svcs.get(name, {})
        check("compose.yaml: %s is the official image (%s)" % (name, svc.get("image")),
              str(svc.get("image", "")).startswith(official) and "build" not in svc)
    for name in ("idemgate", "upstream"):
        b = svcs.get(name, {}).get("build") or {}
        check("compose.yaml: %s is built from docker/Dockerfile on debian:bookworm-slim (target %s)"
              % (name, b.get("target")), b.get("dockerfile") == "docker/Dockerfile"
              and "debian:bookworm-slim" in str((b.get("args") or {}).get("BASE", "")) and b.get("target"))
    host = [n for n, s in svcs.items() if NETWORK_KEYS & set(s) or "network" in (s.get("build") or {})]
    check("compose.yaml: every service on compose's default (bridge) network (else: %s)"
          % (", ".join(host) or "none"), not host)
    check("compose.yaml: the gateway's port is published (%s)" % svcs.get("idemgate", {}).get("ports"),
          any("HTTP_PORT" in str(p) for p in svcs.get("idemgate", {}).get("ports") or []))
    print("compose: %d passed, %d failed" % (passed, failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
