"""nix/pkgs/host-driver.sh, which the Nix serve wrappers source to find the host's NVIDIA driver: run on fake host
trees laid out as Ubuntu, Fedora, Arch, NixOS and WSL lay the driver out, each with the host's libc and libstdc++
beside the driver's libraries, as they are there."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "nix" / "pkgs" / "host-driver.sh"
DRIVER = "580.95.05"
# what a driver installs beside libcuda.so.1 and libnvidia-ml.so.1, and what must never be exposed
DRIVER_FILES = [f"libcuda.so.{DRIVER}", f"libnvidia-ml.so.{DRIVER}", f"libnvidia-ptxjitcompiler.so.{DRIVER}",
                f"libcudadebugger.so.{DRIVER}"]
DRIVER_LINKS = {"libcuda.so.1": f"libcuda.so.{DRIVER}", "libcuda.so": "libcuda.so.1",
                "libnvidia-ml.so.1": f"libnvidia-ml.so.{DRIVER}",
                "libnvidia-ptxjitcompiler.so.1": f"libnvidia-ptxjitcompiler.so.{DRIVER}"}
HOST_FILES = ["libc.so.6", "libstdc++.so.6", "libm.so.6", "libz.so.1"]
EXPOSED = sorted([*DRIVER_FILES, *DRIVER_LINKS])


def install_driver(root: Path, libdir: str, host_libs: bool = True) -> Path:
    d = root / libdir.lstrip("/")
    d.mkdir(parents=True, exist_ok=True)
    for name in DRIVER_FILES + (HOST_FILES if host_libs else []):
        (d / name).write_bytes(b"\x7fELF fake " + name.encode())
    for name, target in DRIVER_LINKS.items():
        (d / name).symlink_to(target)
    return d


def fake_ldconfig(root: Path, path: str, entries: list[tuple[str, str, str]]) -> None:
    """An ldconfig whose -p prints ENTRIES (soname, arch, host path) as glibc's does."""
    lines = [f"{len(entries)} libs found in cache `/etc/ld.so.cache'"]
    lines += [f"\t{so} ({arch}) => {target}" for so, arch, target in entries]
    exe = root / path.lstrip("/")
    exe.parent.mkdir(parents=True, exist_ok=True)
    exe.write_text("#!/bin/sh\ncat <<'EOF'\n" + "\n".join(lines) + "\nEOF\n")
    exe.chmod(0o755)


def run(root: Path, cache: Path, env: dict[str, str] | None = None) -> tuple[str, str]:
    """Sources the script as the wrapper does; returns (LD_LIBRARY_PATH afterwards, stderr)."""
    coreutils = Path(shutil.which("ln")).resolve().parent.parent
    script = SCRIPT.read_text().replace("@coreutils@", str(coreutils))
    assert "@" not in script.replace("$@", "").replace("[@]", "")  # every placeholder is substituted
    code = f'{script}\nglm53_host_driver serve-fast {root}\nprintf "%s" "${{LD_LIBRARY_PATH-}}"'
    full_env = {"PATH": os.environ["PATH"], "XDG_CACHE_HOME": str(cache), **(env or {})}
    proc = subprocess.run(["bash", "-e", "-c", code], env=full_env, capture_output=True, text=True, check=True)
    return proc.stdout, proc.stderr


def exposed(ld_library_path: str, cache: Path) -> tuple[Path, list[str]]:
    first = Path(ld_library_path.split(":")[0])
    assert first.is_relative_to(cache / "glm53" / "host-driver"), ld_library_path
    return first, sorted(p.name for p in first.iterdir())


@pytest.mark.parametrize("layout", ["ubuntu", "fedora", "arch", "nixos", "wsl"])
def test_finds_the_driver_and_exposes_only_its_libraries(tmp_path, layout):
    root, cache = tmp_path / "root", tmp_path / "cache"
    if layout == "ubuntu":  # ldconfig's cache names it, with the 32-bit build first
        d = install_driver(root, "/usr/lib/x86_64-linux-gnu")
        install_driver(root, "/usr/lib/i386-linux-gnu")
        fake_ldconfig(root, "/sbin/ldconfig", [
            ("libcuda.so.1", "libc6", "/usr/lib/i386-linux-gnu/libcuda.so.1"),
            ("libcuda.so.1", "libc6,x86-64", "/usr/lib/x86_64-linux-gnu/libcuda.so.1"),
            ("libnvidia-ml.so.1", "libc6,x86-64", "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"),
        ])
    elif layout == "fedora":  # no ldconfig at the places looked at: the usual directories
        d = install_driver(root, "/usr/lib64")
    elif layout == "arch":
        d = install_driver(root, "/usr/lib")
        install_driver(root, "/usr/lib32")
        fake_ldconfig(root, "/usr/bin/ldconfig", [
            ("libcuda.so.1", "libc6", "/usr/lib32/libcuda.so.1"),
            ("libcuda.so.1", "libc6,x86-64", "/usr/lib/libcuda.so.1"),
            ("libnvidia-ml.so.1", "libc6,x86-64", "/usr/lib/libnvidia-ml.so.1"),
        ])
    elif layout == "nixos":  # /run/opengl-driver/lib wins over an ldconfig left from elsewhere
        d = install_driver(root, "/run/opengl-driver/lib", host_libs=False)
        install_driver(root, "/usr/lib/x86_64-linux-gnu")
        fake_ldconfig(root, "/sbin/ldconfig", [("libcuda.so.1", "libc6,x86-64", "/usr/lib/x86_64-linux-gnu/libcuda.so.1")])
    else:
        d = install_driver(root, "/usr/lib/wsl/lib")
    path, stderr = run(root, cache, {"LD_LIBRARY_PATH": "/opt/before"})

    private, names = exposed(path, cache)
    assert path == f"{private}:/opt/before"
    assert names == EXPOSED
    for name in names:  # each link leads to the driver's own file, of the directory that was found
        assert (private / name).resolve() == (d / name).resolve()
    assert f"the NVIDIA driver's libraries of {d}, through {private}" in stderr  # that directory alone


def test_glm53_driver_dir_comes_first(tmp_path):
    root, cache = tmp_path / "root", tmp_path / "cache"
    install_driver(root, "/run/opengl-driver/lib")
    mine = install_driver(root, "/opt/nvidia/lib")
    path, _ = run(root, cache, {"GLM53_DRIVER_DIR": "/opt/nvidia/lib"})
    private, names = exposed(path, cache)
    assert names == EXPOSED
    assert (private / "libcuda.so.1").resolve() == (mine / f"libcuda.so.{DRIVER}").resolve()


def test_a_second_start_keeps_the_first_ones_directory(tmp_path):
    root, cache = tmp_path / "root", tmp_path / "cache"
    d = install_driver(root, "/usr/lib64")
    first, _ = run(root, cache)
    (d / f"libnvidia-ptxjitcompiler.so.{DRIVER}").unlink()  # an upgrade removed a file
    second, _ = run(root, cache)
    assert first == second
    _, names = exposed(second, cache)
    assert f"libnvidia-ptxjitcompiler.so.{DRIVER}" not in names and "libnvidia-ptxjitcompiler.so.1" not in names
    assert "libcuda.so.1" in names


def test_no_driver_is_said_with_every_place_looked_at(tmp_path):
    root, cache = tmp_path / "root", tmp_path / "cache"
    fake_ldconfig(root, "/sbin/ldconfig", [("libc.so.6", "libc6,x86-64", "/usr/lib/x86_64-linux-gnu/libc.so.6")])
    path, stderr = run(root, cache, {"LD_LIBRARY_PATH": "/opt/before"})
    assert path == "/opt/before"
    assert not (cache / "glm53").exists()
    assert stderr.startswith("serve-fast: no NVIDIA driver found: neither libcuda.so.1 nor libnvidia-ml.so.1 is in ")
    for place in ["/run/opengl-driver/lib", "the cache of /sbin/ldconfig", "/usr/lib/x86_64-linux-gnu", "/usr/lib64",
                  "/usr/lib,", "/usr/lib/wsl/lib", "/usr/local/nvidia/lib64"]:
        assert place in stderr, place
    assert "GLM53_DRIVER_DIR" in stderr
