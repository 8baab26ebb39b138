"""Every C source of a folder named in its module map, every name in the map a real file.

usage: check_module_maps.py SOURCE_ROOT

A folder whose modules share a private header keeps, in that header's opening
comment, its module map: each file and what it calls (store/store_impl.h,
daemon/fuse/fuse_impl.h, daemon/ops/impl.h, cluster/cluster_impl.h,
client/client_impl.h). The maps drifted as files were split (issue 59): a new file
missing from its map, a map naming a file that had gone. A folder's private header
is the one named `impl.h` or `<folder>_impl.h` (store/store_impl.h); the headers
that are a kernel's body built per instruction set (store/quant_impl.h,
blend/kernels_impl.h) are not named after their folder and carry no map.

For each such header this check reads its opening comment and reports
  - a .c or .cu file of the folder (not of its subfolders) that the map does not name;
  - a file the map names (NAME.c, NAME.cu, NAME.h, or a path such as daemon/fuse/fuse.h)
    that exists neither in the folder, nor under it, nor from the source root.
It first checks itself on a made-up map, and fails when one of the maps above is not
found, so that it cannot pass by matching nothing.
"""

import os
import re
import sys

# The maps there are today: a renamed or moved header must not drop out unnoticed.
REQUIRED = ("store", "daemon/fuse", "daemon/ops", "cluster", "client")
SOURCE_EXT = (".c", ".cu")
# A file name in prose: word characters, dots and slashes, ending in .c, .cu or .h
# ("quant_impl.h's" names quant_impl.h; "e.g." and "etc." name nothing).
NAME = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+(?:\.[\w-]+)*\.(?:cu|c|h))(?![\w/])")
SKIP_DIRS = {"node_modules", "__pycache__"}


def opening_comment(text):
    """The first /* ... */ comment of a C file ('' when it has none)."""
    m = re.search(r"/\*.*?\*/", text, re.S)
    return m.group(0) if m else ""


def names(comment):
    """The file names a map mentions."""
    return set(NAME.findall(comment))


def problems(folder, sources, comment, exists):
    """What is wrong with one folder's map.

    folder: the folder, relative to the root; sources: its .c/.cu file names;
    comment: the map; exists(path): whether a file exists (a path from the root),
    or for a bare name whether one of that name is in the folder or under it.
    """
    out = []
    named = names(comment)
    bare = {os.path.basename(n) for n in named}
    for src in sorted(sources):
        if src not in bare and os.path.join(folder, src) not in named:
            out.append(f"{src} is not in the module map")
    for n in sorted(named):
        anywhere_under = "/" not in n and exists("**/" + n)
        if not (exists(os.path.join(folder, n)) or exists(n) or anywhere_under):
            out.append(f"the map names {n}, which does not exist")
    return out


def self_check():
    """The check on a made-up folder: it must flag what is wrong and pass what is not."""
    files = {"x/a.c", "x/b.c", "x/k.cu", "x/x_impl.h", "x/sub/s.h", "y/y.h"}

    def exists(p):
        if p.startswith("**/"):
            return any(f.startswith("x/") and f.endswith("/" + p[3:]) for f in files)
        return os.path.normpath(p) in files

    comment = ("/*\n * x_impl — a.c (calls b), k.cu; s.h's types and y/y.h,\n"
               " * e.g. as gone.c said (x_impl.h itself).\n */")
    got = problems("x", ["a.c", "b.c", "k.cu"], comment, exists)
    want = ["b.c is not in the module map", "the map names gone.c, which does not exist"]
    if got != want:
        sys.exit(f"check_module_maps: self-check failed: {got} != {want}")


def main(root):
    self_check()
    root = os.path.abspath(root)
    found, failures = set(), []

    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames
                             if not d.startswith((".", "build")) and d not in SKIP_DIRS
                             and not os.path.exists(os.path.join(dirpath, d, "CMakeCache.txt")))
        rel = os.path.relpath(dirpath, root)
        base = os.path.basename(dirpath)
        header = next((h for h in ("impl.h", base + "_impl.h") if h in filenames), None)
        if rel == "." or not header:
            continue
        found.add(rel)
        with open(os.path.join(dirpath, header), encoding="utf-8") as f:
            comment = opening_comment(f.read())
        sources = [f for f in filenames if f.endswith(SOURCE_EXT)]

        def exists(p, rel=rel):
            if p.startswith("**/"):
                return any(p[3:] in fs for _, _, fs in os.walk(os.path.join(root, rel)))
            return os.path.isfile(os.path.join(root, p))

        for msg in problems(rel, sources, comment, exists):
            failures.append(f"{rel}/{header}: {msg}")

    for req in REQUIRED:
        if req not in found:
            failures.append(f"{req}: no private header with a module map found "
                            f"({req}/{os.path.basename(req)}_impl.h or {req}/impl.h)")
    for line in failures:
        print(line)
    print(f"check_module_maps: {len(found)} maps ({', '.join(sorted(found))}), "
          f"{len(failures)} problems")
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
