"""Does vcpkg "supports" expression A allow no platform that B excludes? Used by packaging.vcpkg_files to check that
gpukit's port supports no more than the cuda port it depends on. Usage: vcpkg_supports.py A B (exit 0: yes)."""
import itertools
import re
import sys

SYSTEMS = ["windows", "uwp", "linux", "osx", "android", "freebsd", "openbsd", "emscripten", "ios"]
ARCHES = ["x64", "x86", "arm", "arm64", "wasm32"]


def allows(expression, system, arch):
    if not re.fullmatch(r"[a-z0-9_ &|!()]+", expression):
        sys.exit("not a vcpkg platform expression: %r" % expression)
    names = {name: False for name in SYSTEMS + ARCHES + ["static", "native", "mingw", "xbox", "staticcrt"]}
    names[system] = names[arch] = True
    names["windows"] = system in ("windows", "uwp")
    python = re.sub(r"[a-z0-9_]+", lambda m: "names[%r]" % m.group(0), expression)
    python = python.replace("&", " and ").replace("|", " or ").replace("!", " not ")
    return eval(python, {"names": names})  # only names, and/or/not and parentheses are left


port, cuda = sys.argv[1], sys.argv[2]
wider = [(s, a) for s, a in itertools.product(SYSTEMS, ARCHES) if allows(port, s, a) and not allows(cuda, s, a)]
supported = [(s, a) for s, a in itertools.product(SYSTEMS, ARCHES) if allows(port, s, a)]
print("port supports: " + ", ".join("%s-%s" % p for p in supported))
if wider:
    print("but the cuda port does not support: " + ", ".join("%s-%s" % p for p in wider))
    sys.exit(1)
if ("linux", "x64") not in supported:
    print("the port must support linux-x64")
    sys.exit(1)
