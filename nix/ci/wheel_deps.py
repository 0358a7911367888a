"""A dry run of autoPatchelf over the pinned wheels that hold machine code, and of the two run-time loaders the Nix
packages patch (nix/ci/check.sh's wheels tier).

For every native wheel of nix/pins/pypi.json and every CUDA library wheel, as fetched by the pins tier, each x86-64
ELF file's NEEDED entries must be provided: by the files the package installs from the wheel itself, by its build
inputs (gcc's runtime and zlib by their sonames below, nixpkgs' CUDA packages by the sonames torch takes from them,
the CUDA library wheels by the files their layout installs), by glibc, or be a driver library the package leaves
missing on purpose (autoPatchelfIgnoreMissingDeps). What autoPatchelf is given comes from the evaluated derivations
(nix/ci/eval.nix). Then the loaders that NEEDED does not show:

- cuda-bindings binds its CUDA libraries at run time through cuda.pathfinder: every library one of its modules binds
  must be in the store root the cuda-pathfinder package searches first, where the pinned pathfinder's descriptor
  says it looks, or be named as taken elsewhere (the driver's); the patched text must be in the pinned wheel.
- Triton looks libcuda.so.1 up with /sbin/ldconfig: the text triton.nix replaces must be in the pinned wheel.

    python3 nix/ci/wheel_deps.py EVAL.json WHEEL_PATHS [STORE_ROOT]

WHEEL_PATHS lists the fetched files' store paths, one a line; STORE_ROOT is prefixed to each (the chroot's root).
Prints one line on success; otherwise every library not provided, naming the wheel and the file that needs it.
"""

from __future__ import annotations

import ast
import fnmatch
import json
import os
import struct
import sys
import zipfile

# Always in autoPatchelf's search path: the C library of the compiler the package is built with (glibc 2.40's).
GLIBC = frozenset({"ld-linux-x86-64.so.2", "libc.so.6", "libm.so.6", "libmvec.so.1", "libpthread.so.0", "libdl.so.2",
                   "librt.so.1", "libutil.so.1", "libresolv.so.2", "libanl.so.1"})
# The build inputs by pname that are toolchain runtime: stdenv.cc.cc.lib (gcc's lib output) and zlib.
TOOLCHAIN = {
    "gcc": frozenset({"libstdc++.so.6", "libgcc_s.so.1", "libgomp.so.1", "libquadmath.so.0", "libatomic.so.1"}),
    "zlib": frozenset({"libz.so.1"}),
}
# The NVIDIA driver's user-space libraries: from the machine the program runs on, never the store.
DRIVER = frozenset({"libcuda.so.1", "libnvidia-ml.so.1"})
# cuda-bindings' modules under cuda/bindings/_internal/ whose name is not that of the library they bind (the others
# bind pathfinder's library of their own name, ignoring case); None: binds no library.
BINDINGS_MODULES = {"runtime": "cudart", "runtime_ptds": "cudart", "driver": "cuda", "utils": None}
# Not machine code, and many: skipped without opening.
TEXT_SUFFIXES = (".py", ".pyi", ".pyc", ".h", ".hpp", ".cuh", ".hxx", ".inl", ".json", ".txt", ".md", ".cmake", ".pxd",
                 ".pyx", ".typed", ".bc", ".cu", ".c", ".cpp", ".proto", ".yaml", ".ll", ".mlir", ".td")
EM_X86_64 = 62


def elf_needed(read_at) -> list[str] | None:
    """DT_NEEDED of an x86-64 ELF file, or None when it is not one; read_at(offset, size) returns its bytes."""
    head = read_at(0, 64)
    if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2 or struct.unpack_from("<H", head, 18)[0] != EM_X86_64:
        return None
    phoff, = struct.unpack_from("<Q", head, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", head, 0x36)
    loads, dynamic = [], None
    table = read_at(phoff, phentsize * phnum)
    for i in range(phnum):
        p_type, _, p_offset, p_vaddr, _, p_filesz = struct.unpack_from("<IIQQQQ", table, i * phentsize)
        if p_type == 1:
            loads.append((p_vaddr, p_offset, p_filesz))
        elif p_type == 2:
            dynamic = (p_offset, p_filesz)
    if dynamic is None:  # statically linked: nothing to patch
        return []
    entries = read_at(*dynamic)
    needed, strtab, strsz = [], None, None
    for i in range(0, len(entries) - 15, 16):
        tag, value = struct.unpack_from("<qQ", entries, i)
        if tag == 0:
            break
        if tag == 1:
            needed.append(value)
        elif tag == 5:
            strtab = value
        elif tag == 10:
            strsz = value
    offset = next(o + strtab - v for v, o, n in loads if v <= strtab < v + n)
    strings = read_at(offset, strsz)
    return [strings[i:strings.index(b"\0", i)].decode() for i in needed]


def member_reader(archive: zipfile.ZipFile, info: zipfile.ZipInfo):
    """read_at for a member of a wheel, decompressing only as far as asked (the dynamic section is often near the end
    of a large library, but the string table near its start)."""
    stream, data = archive.open(info), bytearray()

    def read_at(offset: int, size: int) -> bytes:
        while len(data) < offset + size:
            chunk = stream.read(max(1 << 20, offset + size - len(data)))
            if not chunk:
                break
            data.extend(chunk)
        return bytes(data[offset:offset + size])

    return read_at


def elf_files(path: str, select=lambda name: True) -> dict[str, list[str]]:
    """Member name -> NEEDED, for the x86-64 ELF files among the members of the wheel at PATH that SELECT accepts."""
    found = {}
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            if info.is_dir() or info.file_size < 64 or info.filename.endswith(TEXT_SUFFIXES) or not select(info.filename):
                continue
            needed = elf_needed(member_reader(archive, info))
            if needed is not None:
                found[info.filename] = needed
    return found


def read_member(path: str, name: str) -> str:
    with zipfile.ZipFile(path) as archive:
        return archive.read(name).decode()


def descriptors(catalog: str) -> dict[str, dict]:
    """cuda.pathfinder's library descriptors (name -> packaged_with, linux_sonames, anchor_rel_dirs_linux), read
    from its descriptor_catalog.py without importing it; a field a descriptor leaves out has the class's default."""
    tree = ast.parse(catalog)
    defaults = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "DescriptorSpec":
            for field in node.body:
                if isinstance(field, ast.AnnAssign) and field.value is not None:
                    try:
                        defaults[field.target.id] = ast.literal_eval(field.value)
                    except ValueError:
                        pass
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "DescriptorSpec":
            fields = dict(defaults)
            for keyword in node.keywords:
                try:
                    fields[keyword.arg] = ast.literal_eval(keyword.value)
                except ValueError:
                    pass
            found[fields["name"]] = fields
    return found


def check_autopatchelf(wheels: dict, path_of) -> tuple[list[str], int, set[str]]:
    """Every NEEDED of every native wheel provided; returns (problems, ELF files read, driver libraries left)."""
    problems, count, left = [], 0, set()
    installed = {}  # CUDA library wheel -> member -> NEEDED, of the files its layout installs
    for name, lib in wheels["cudaWheelLibs"].items():
        prefix = f"nvidia/{lib['dir']}/lib/"
        installed[name] = elf_files(path_of(lib["wheel"]), lambda m, p=prefix, g=lib["files"]: m.startswith(p)
                                    and "/" not in m[len(p):] and any(fnmatch.fnmatchcase(m[len(p):], f) for f in g))
        if not installed[name]:
            problems.append(f"{name}: its layout ({prefix}{', '.join(lib['files'])}) installs no library of {lib['wheel']}")
    units = [(name, lib, installed[name]) for name, lib in wheels["cudaWheelLibs"].items()]
    units += [(name, pkg, elf_files(path_of(pkg["wheel"]))) for name, pkg in wheels["packages"].items()]
    for name, unit, elves in units:
        provided, unknown = set(GLIBC) | {os.path.basename(m) for m in elves}, []
        for pname in unit["inputs"]:
            if pname in TOOLCHAIN:
                provided |= TOOLCHAIN[pname]
            elif pname in wheels["cudaPackages"]:
                provided |= set(wheels["cudaPackages"][pname])
            elif pname in installed:
                provided |= {os.path.basename(m) for m in installed[pname]}
            else:
                unknown.append(pname)
        if unknown:
            problems.append(f"{name}: build inputs whose libraries the dry run does not know: {', '.join(unknown)}")
        if set(unit["ignore"]) - DRIVER:
            problems.append(f"{name}: leaves {', '.join(sorted(set(unit['ignore']) - DRIVER))} missing, not a driver library")
        for member, needed in sorted(elves.items()):
            count += 1
            for lib in needed:
                if lib in unit["ignore"]:
                    left.add(f"{lib} ({name})")
                elif lib not in provided:
                    problems.append(f"{unit['wheel']}: {member} needs {lib}, which neither the wheel, its build inputs "
                                    f"({', '.join(unit['inputs'])}) nor glibc provides")
    return problems, count, left


def check_loaders(wheels: dict, path_of) -> tuple[list[str], str]:
    problems = []
    triton = wheels["triton"]
    occurrences = read_member(path_of(triton["wheel"]), triton["file"]).count(triton["text"])
    if occurrences != 1:
        problems.append(f"triton.nix replaces {triton['text']!r} in {triton['file']}, which {triton['wheel']} holds "
                        f"{occurrences} times")

    finder = wheels["cuda-pathfinder"]
    search = read_member(path_of(finder["wheel"]), finder["search"]["file"])
    for text in (finder["search"]["text"], finder["search"]["uses"]):
        if search.count(text) != 1:
            problems.append(f"cuda-pathfinder.nix relies on {text!r} in {finder['search']['file']}, which "
                            f"{finder['wheel']} holds {search.count(text)} times")
    known = descriptors(read_member(path_of(finder["wheel"]), "cuda/pathfinder/_dynamic_libs/descriptor_catalog.py"))
    by_lower = {name.lower(): name for name in known}
    with zipfile.ZipFile(path_of(finder["bindings"])) as archive:
        modules = sorted({os.path.basename(m).split(".")[0] for m in archive.namelist()
                          if m.startswith("cuda/bindings/_internal/") and m.endswith(".so")})
    bound = {}
    for module in modules:
        name = BINDINGS_MODULES[module] if module in BINDINGS_MODULES else by_lower.get(module.lower(), "")
        if name is None:
            continue
        if name not in known:
            problems.append(f"cuda-bindings' module {module} binds a library cuda.pathfinder has no descriptor of")
            continue
        bound[name] = known[name]
    store, elsewhere = finder["libraries"], finder["elsewhere"]
    for name, desc in sorted(bound.items()):
        sonames = "/".join(desc["linux_sonames"])
        if name in store:
            if store[name]["dir"] not in desc["anchor_rel_dirs_linux"]:
                problems.append(f"cuda-bindings binds {name} ({sonames}): cuda-pathfinder.nix links it under "
                                f"{store[name]['dir']}, pathfinder looks under {', '.join(desc['anchor_rel_dirs_linux'])}")
            if not fnmatch.fnmatchcase(desc["linux_sonames"][0], store[name]["files"]):
                problems.append(f"cuda-bindings binds {name} ({sonames}): cuda-pathfinder.nix links only "
                                f"{store[name]['files']} of {store[name]['package']}")
        elif name not in elsewhere:
            problems.append(f"cuda-bindings binds {name} ({sonames}, packaged with the {desc['packaged_with']}), which "
                            "cuda-pathfinder.nix neither links into its root nor names as taken elsewhere")
    for name in sorted(set(store) | set(elsewhere)):
        if name not in bound:
            problems.append(f"cuda-pathfinder.nix names {name}, which cuda-bindings does not bind")
    summary = (f"cuda-bindings binds {len(bound)} libraries: {', '.join(n for n in sorted(bound) if n in store)} from "
               f"the store, {', '.join(n for n in sorted(bound) if n in elsewhere)} not")
    return problems, summary


def main(argv: list[str]) -> int:
    with open(argv[1]) as f:
        wheels = json.load(f)["wheels"]
    root = argv[3] if len(argv) > 3 else ""
    with open(argv[2]) as f:
        fetched = {os.path.basename(p)[33:]: root + p for p in f.read().split()}

    def path_of(filename: str) -> str:
        if filename not in fetched:
            raise SystemExit(f"{filename} was not fetched by the pins tier")
        return fetched[filename]

    problems, count, left = check_autopatchelf(wheels, path_of)
    loader_problems, loaders = check_loaders(wheels, path_of)
    problems += loader_problems
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 1
    n = len(wheels["packages"]) + len(wheels["cudaWheelLibs"])
    print(f"{n} wheels ({len(wheels['cudaWheelLibs'])} of CUDA libraries), {count} ELF files: every library they need "
          f"is provided, or the driver's and left to the host ({', '.join(sorted(left))}); {loaders}; the Triton and "
          "cuda-pathfinder patches apply")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
