#!/usr/bin/env python3
"""Record what the pinned torch wheel needs from the CUDA libraries, and whether each candidate version provides it.

    python3 nix/pins/torch_cuda.py              # rewrite nix/pins/torch-cuda.json
    python3 nix/pins/torch_cuda.py --wheels DIR # keep the downloaded wheels in DIR (default: a cache directory)

Run by hand after ``nix/pins/update.py``, never by CI; CI checks the record against the pins offline
(``nix/lib/torch-cuda.nix``, golden-tested), and the Nix build refuses a nixpkgs CUDA package whose version the record
does not show to satisfy torch (``nix/pkgs/torch.nix``).

Steps, in order:

1. Download the torch wheel of ``nix/pins/pypi.json`` (its sha256 checked) and read every ELF file in it: the
   libraries it NEEDs and the symbols it imports. A symbol bound to a version node names its library; an unversioned
   one is attributed to the NEEDed CUDA library whose required build exports it. Weak symbols are left out: the
   loader does not fail on them.
2. The versions to check: for a library nixpkgs provides (its wheel is under ``replaced``), the builds of every CUDA
   13.2 release ``cudaPackages_13_2`` has had (``CUDA_RELEASES``, read from PyPI's ``cuda-toolkit`` metapackage of
   each release, which names the same builds as NVIDIA's redistributable manifests that nixpkgs unpacks); for a
   library linked from its wheel (under ``libraries``), the pinned build and the builds nixpkgs was read to carry
   (``NIXPKGS_READ``).
3. Download each of those wheels from PyPI (sha256 checked against the index), read the library's exported symbols,
   and list the imports it lacks. ``import torch`` binds every import at load (CPython dlopens with RTLD_NOW), so one
   missing symbol is a failed import.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import struct
import sys
import urllib.request
import zipfile
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
INDEX = "https://pypi.org/simple/"

# Each CUDA library torch may NEED: the pip wheel that provides it and the cudaPackages attribute that does.
SONAMES = {
    "libcudart.so.13": ("nvidia-cuda-runtime", "cuda_cudart"),
    "libcupti.so.13": ("nvidia-cuda-cupti", "cuda_cupti"),
    "libnvrtc.so.13": ("nvidia-cuda-nvrtc", "cuda_nvrtc"),
    "libcublas.so.13": ("nvidia-cublas", "libcublas"),
    "libcublasLt.so.13": ("nvidia-cublas", "libcublas"),
    "libcufft.so.12": ("nvidia-cufft", "libcufft"),
    "libcufile.so.0": ("nvidia-cufile", "libcufile"),
    "libcurand.so.10": ("nvidia-curand", "libcurand"),
    "libcusolver.so.12": ("nvidia-cusolver", "libcusolver"),
    "libcusparse.so.12": ("nvidia-cusparse", "libcusparse"),
    "libnvToolsExt.so.1": ("nvidia-nvtx", "cuda_nvtx"),
    "libnvJitLink.so.13": ("nvidia-nvjitlink", "libnvjitlink"),
    "libcudnn.so.9": ("nvidia-cudnn-cu13", "cudnn"),
    "libcusparseLt.so.0": ("nvidia-cusparselt-cu13", "libcusparse_lt"),
    "libnccl.so.2": ("nvidia-nccl-cu13", "nccl"),
    "libnvshmem_host.so.3": ("nvidia-nvshmem-cu13", "libnvshmem"),
}
# The driver's libraries: they come from the machine the server runs on.
DRIVER = {"libcuda.so.1", "libnvidia-ml.so.1"}
# glibc, gcc's runtime and zlib: from the store's toolchain, not CUDA.
SYSTEM = {"libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1", "ld-linux-x86-64.so.2",
          "libstdc++.so.6", "libgcc_s.so.1", "libquadmath.so.0", "libz.so.1"}
# Every CUDA 13.2 release nixpkgs' cudaPackages_13_2 has pointed at: init at 13.2.0 (NixOS/nixpkgs#498523), then
# 13.2.1 (#525132) and 13.2.2 (pkgs/development/cuda-modules/_cuda/manifests/cuda/redistrib_13.2.2.json). Which one
# the pinned nixos-26.05 revision has could not be read here.
CUDA_RELEASES = ["13.2.0", "13.2.1", "13.2.2"]
# Builds of the separately versioned libraries that nixpkgs carried at the revisions read near the pin (nccl.nix,
# libnvshmem.nix, and cudaPackages_13_2's cudnn and cusparselt versions), as the PyPI builds of the same versions.
NIXPKGS_READ = {
    "nvidia-nccl-cu13": ["2.27.7", "2.28.7", "2.30.7"],
    "nvidia-nvshmem-cu13": ["3.4.5", "3.6.5"],
    "nvidia-cudnn-cu13": ["9.20.0.48", "9.27.0.42"],
    "nvidia-cusparselt-cu13": ["0.10.0"],
}


# --- ELF: the dynamic section's NEEDED entries and the dynamic symbols with their versions -------------------------
SHT_DYNSYM, SHT_DYNAMIC, SHT_VERNEED, SHT_VERSYM = 11, 6, 0x6FFFFFFE, 0x6FFFFFFF
DT_NEEDED, DT_SONAME = 1, 14
STB_WEAK = 2


def read_elf(data: bytes) -> dict:
    """NEEDED, SONAME, undefined symbols as (name, file of their version need or None, weak) and exported names of a
    64-bit little-endian ELF file."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]

    def strings(index: int):
        offset = sections[index][4]
        return lambda at: data[offset + at:data.index(b"\0", offset + at)].decode()

    result = {"needed": [], "soname": None, "undefined": [], "exported": set()}
    by_type = {s[1]: (i, s) for i, s in enumerate(sections)}
    if SHT_DYNAMIC in by_type:
        _, (_, _, _, _, offset, size, link, _, _, _) = by_type[SHT_DYNAMIC]
        name = strings(link)
        for at in range(offset, offset + size, 16):
            tag, value = struct.unpack_from("<qQ", data, at)
            if tag == DT_NEEDED:
                result["needed"].append(name(value))
            elif tag == DT_SONAME:
                result["soname"] = name(value)
    if SHT_DYNSYM not in by_type:
        return result
    _, (_, _, _, _, sym_off, sym_size, sym_link, _, _, _) = by_type[SHT_DYNSYM]
    name = strings(sym_link)
    version_file = {}  # version index -> the library its need names
    if SHT_VERNEED in by_type:
        _, (_, _, _, _, offset, _, link, count, _, _) = by_type[SHT_VERNEED]
        vname = strings(link)
        at = offset
        for _ in range(count):
            _, cnt, file, aux, nxt = struct.unpack_from("<HHIII", data, at)
            aux_at = at + aux
            for _ in range(cnt):
                _, _, other, _, aux_next = struct.unpack_from("<IHHII", data, aux_at)
                version_file[other] = vname(file)
                aux_at += aux_next
            at += nxt
    versym = by_type.get(SHT_VERSYM, (None, None))[1]
    for i in range(1, sym_size // 24):
        st_name, st_info, _, st_shndx = struct.unpack_from("<IBBH", data, sym_off + i * 24)
        symbol = name(st_name)
        if not symbol:
            continue
        if st_shndx == 0:
            index = struct.unpack_from("<H", data, versym[4] + 2 * i)[0] & 0x7FFF if versym else 0
            result["undefined"].append((symbol, version_file.get(index), st_info >> 4 == STB_WEAK))
        elif st_info >> 4 != 0:
            result["exported"].add(symbol)
    return result


# --- PyPI ------------------------------------------------------------------------------------------------------------
def index_files(name: str) -> list[dict]:
    request = urllib.request.Request(INDEX + name + "/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)["files"]


def fetch(url: str, sha256: str, cache: Path) -> Path:
    path = cache / url.rsplit("/", 1)[1]
    if not (path.exists() and hashlib.sha256(path.read_bytes()).hexdigest() == sha256):
        with urllib.request.urlopen(url, timeout=600) as response:
            body = response.read()
        if hashlib.sha256(body).hexdigest() != sha256:
            raise SystemExit(f"{url}: sha256 differs from {sha256}")
        path.write_bytes(body)
    return path


def pypi_wheel(name: str, version: str, cache: Path) -> Path:
    """The wheel of NAME==VERSION from PyPI (its x86_64 Linux one where there are several), downloaded once and
    checked against the index's sha256."""
    stem = re.sub(r"[-_.]+", "_", name) + "-" + version + "-"
    wheels = [e for e in index_files(name) if e["filename"].startswith(stem) and e["filename"].endswith(".whl")]
    linux = [e for e in wheels if re.search(r"linux[0-9_]*_x86_64\.whl$|-none-any\.whl$", e["filename"])]
    if not linux:
        raise SystemExit(f"PyPI has no x86_64 Linux wheel of {name} {version}")
    return fetch(linux[0]["url"], linux[0]["hashes"]["sha256"], cache)


def toolkit_builds(release: str, cache: Path) -> dict[str, str]:
    """The build of each nvidia-* wheel that PyPI's cuda-toolkit==RELEASE names (its extras pin them with ==X.*)."""
    with zipfile.ZipFile(pypi_wheel("cuda-toolkit", release, cache)) as zf:
        metadata = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    return {m.group(1): m.group(2) for m in re.finditer(r"^Requires-Dist: (nvidia-[a-z0-9-]+)==([0-9.]+)\.\*", metadata, re.M)}


def library_exports(wheel: Path, soname: str) -> set[str]:
    with zipfile.ZipFile(wheel) as zf:
        member = next((n for n in zf.namelist() if n.rsplit("/", 1)[-1] == soname), None)
        if member is None:
            raise SystemExit(f"{wheel.name} holds no {soname}")
        return read_elf(zf.read(member))["exported"]


# --- the record ------------------------------------------------------------------------------------------------------
def torch_imports(wheel: Path, required_exports) -> tuple[dict[str, dict], set[str]]:
    """Per CUDA soname: the files that NEED it and the symbols they import from it; and the driver sonames NEEDed."""
    needs: dict[str, dict] = defaultdict(lambda: {"neededBy": set(), "symbols": set()})
    driver = set()
    with zipfile.ZipFile(wheel) as zf:
        members = [n for n in zf.namelist() if re.search(r"\.so(\.\d+)*$", n)]
        elves = {}
        for member in members:
            data = zf.read(member)
            if data[:4] == b"\x7fELF":
                elves[member] = read_elf(data)
    own = {e["soname"] or m.rsplit("/", 1)[-1] for m, e in elves.items()}
    unknown = set()
    for member, elf in sorted(elves.items()):
        cuda = [so for so in elf["needed"] if so in SONAMES]
        driver |= {so for so in elf["needed"] if so in DRIVER}
        unknown |= {so for so in elf["needed"] if so not in SONAMES and so not in DRIVER and so not in SYSTEM and so not in own}
        for so in cuda:
            needs[so]["neededBy"].add(member.rsplit("/", 1)[-1])
        for symbol, version_of, weak in elf["undefined"]:
            if weak:
                continue
            if version_of in SONAMES:
                needs[version_of]["symbols"].add(symbol)
            elif version_of is None or version_of not in SYSTEM:
                owner = next((so for so in cuda if symbol in required_exports(so)), None)
                if owner:
                    needs[owner]["symbols"].add(symbol)
    if unknown:
        raise SystemExit(f"torch NEEDs libraries this script does not place: {', '.join(sorted(unknown))}; add them to SONAMES or SYSTEM")
    return needs, driver


def record(pins: dict, cache: Path) -> dict:
    torch = pins["packages"]["torch"]
    wheel = fetch(torch["url"], torch["sha256"], cache)
    builds = {release: toolkit_builds(release, cache) for release in CUDA_RELEASES}

    def required(wheel_name: str) -> str:
        if wheel_name in pins["libraries"]:
            return pins["libraries"][wheel_name]["version"]
        return pins["replaced"][wheel_name]

    exports_cache: dict[tuple[str, str], set[str]] = {}

    def exports(soname: str, version: str) -> set[str]:
        wheel_name = SONAMES[soname][0]
        if (soname, version) not in exports_cache:
            exports_cache[soname, version] = library_exports(pypi_wheel(wheel_name, version, cache), soname)
        return exports_cache[soname, version]

    needs, driver = torch_imports(wheel, lambda so: exports(so, required(SONAMES[so][0])))
    libraries = {}
    for soname, need in sorted(needs.items()):
        wheel_name, attr = SONAMES[soname]
        if wheel_name in pins["libraries"]:
            versions = sorted({required(wheel_name), *NIXPKGS_READ.get(wheel_name, [])}, key=version_key)
        else:
            versions = sorted({b[wheel_name] for b in builds.values()} | {required(wheel_name)}, key=version_key)
        libraries[soname] = {
            "wheel": wheel_name,
            "nixpkgs": attr,
            "required": required(wheel_name),
            "neededBy": sorted(need["neededBy"]),
            "imports": len(need["symbols"]),
            "missing": {v: sorted(need["symbols"] - exports(soname, v)) for v in versions},
        }
        print(f"{soname}: {len(need['symbols'])} imports; missing " +
              ", ".join(f"{v}: {len(m)}" for v, m in libraries[soname]["missing"].items()), file=sys.stderr)
    wheels = sorted({lib["wheel"] for lib in libraries.values()})
    return {
        "torch": {"filename": torch["filename"], "sha256": torch["sha256"]},
        "driver": sorted(driver),
        "cudaReleases": {r: {w: b[w] for w in wheels if w in b} for r, b in builds.items()},
        "libraries": libraries,
    }


def version_key(version: str) -> list[int]:
    return [int(part) for part in re.findall(r"\d+", version)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pins", type=Path, default=REPO / "nix" / "pins" / "pypi.json")
    ap.add_argument("--out", type=Path, default=REPO / "nix" / "pins" / "torch-cuda.json")
    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    ap.add_argument("--wheels", type=Path, default=cache_home / "glm53" / "wheels",
                    help="where downloaded wheels are kept (several GB)")
    args = ap.parse_args()
    args.wheels.mkdir(parents=True, exist_ok=True)
    text = json.dumps(record(json.loads(args.pins.read_text()), args.wheels), indent=2, sort_keys=True) + "\n"
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
