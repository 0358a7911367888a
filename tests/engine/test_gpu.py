"""Reading the driver and CUDA versions that /server_info shows for a GPU engine (device_facts itself runs in
tests/gpu, against a real device)."""

from __future__ import annotations

import pytest

from glm53.engine.gpu import cuda_driver_version, nvidia_driver_version


@pytest.mark.parametrize("text,version", [
    (("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n"
      "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n"), "550.54.15"),
    (("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (dvs-builder@U16-I2-C03-12-4)  "
      "Thu Oct  2 18:55:32 UTC 2025\nGCC version:  gcc version 13.3.0\n"), "580.159.04"),
    ("NVRM version: NVIDIA UNIX aarch64 Kernel Module  535.104\n", "535.104"),
    ("GCC version:  gcc version 12.2.0\n", None),
])
def test_driver_version_from_the_kernel_module(tmp_path, text, version):
    path = tmp_path / "version"
    path.write_text(text)
    assert nvidia_driver_version(path) == version


def test_no_driver_means_no_versions(tmp_path):
    assert nvidia_driver_version(tmp_path / "absent") is None
    assert cuda_driver_version("libcuda-that-does-not-exist.so.1") is None
