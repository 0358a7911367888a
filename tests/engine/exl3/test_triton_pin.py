"""Pinned Triton autotune picks, on the CPU: the pick file, matching keys, counting or strict, refusing other GPUs.

The kernels are stand-ins (``fake_triton``) with the attributes Triton 3.6 and exllamav3 1.6.5 have; the last test
pins a real ``triton.autotune`` kernel where Triton is installed (it launches nothing).
"""

from __future__ import annotations

import importlib
import json
import logging
from types import SimpleNamespace

import pytest
import torch

from glm53 import cli, config
from glm53.engine.exl3 import backend, triton_pin
from glm53.engine.exl3.patches import InternalsChanged
from glm53.engine.exl3.triton_pin_file import (
    ArchitectureMismatch,
    PinFileError,
    VersionMismatch,
    decode_value,
    document,
    dumps,
    encode_key,
    key_text,
    load,
    merge,
)
from glm53.tools import triton_pin_record
from tests.engine.exl3 import fake_triton

SCALE = "tests.engine.exl3.fake_kernels:scale_kernel"
NORM = "tests.engine.exl3.fake_kernels:norm_kernel"
H200 = [(0, "NVIDIA H200", (9, 0))]
X32 = torch.zeros(4)  # the key's dtype component: "torch.float32"
BF16 = torch.zeros(4, dtype=torch.bfloat16)


def cfg(kwargs, num_warps=4, num_stages=3):
    return {"kwargs": kwargs, "num_warps": num_warps, "num_stages": num_stages, "num_ctas": 1}


def pin_doc(kernels, **top):
    doc = document(kernels, gpu_name="NVIDIA H200", capability=(9, 0), versions={"triton": "3.6.0", "exllamav3": "1.6.5"})
    doc.update(top)
    return doc


def write(tmp_path, doc, name="pins.json"):
    path = tmp_path / name
    path.write_text(dumps(doc))
    return path


SCALE_128 = {"key": [128, "torch.float32"], "config": cfg({"BLOCK": 64}, num_warps=2)}
NORM_128 = {"key": [128, 1, "torch.bfloat16", "torch.bfloat16"], "config": cfg({"BT": 32}, num_warps=1, num_stages=3)}


@pytest.fixture
def kernels(monkeypatch):
    """A fresh set of stand-in kernels (as in a new process), with triton_pin pointed at the stand-ins."""
    from tests.engine.exl3 import fake_kernels

    importlib.reload(fake_kernels)
    monkeypatch.setattr(triton_pin, "_autotuner_class", lambda: fake_triton.FakeAutotuner)
    monkeypatch.setattr(triton_pin, "_visible_gpus", lambda: H200)
    monkeypatch.setattr(triton_pin, "runtime_versions", lambda: {"triton": "3.6.0", "exllamav3": "1.6.5", "torch": None})
    monkeypatch.setattr(fake_triton.FakeAutotuner, "winner", 0)
    monkeypatch.setattr(fake_triton, "CURRENT_KIND", ("NVIDIA H200", 9, 0))
    yield fake_kernels
    triton_pin.uninstall()


def run_scale(k, n):
    return k.scale_kernel.run(X32, n, grid=(1,), warmup=False)


def run_norm(k, d=128, nb=1):
    return k.norm_kernel.run(x=BF16, y=BF16, D=d, NB=nb, grid=(1,), warmup=False)


# --- keys


@pytest.mark.parametrize("key", [
    (128, 1, "torch.bfloat16", "torch.float32"),
    (True, False, None, 0, 1),
    (1.5, -0.0, float("inf"), float("-inf")),
    ((1, 2), [3, "a"], ((4,), [])),
    (torch.float16, torch.int64, (torch.bfloat16, 7)),
    (),
])
def test_a_key_survives_json_unchanged(key):
    back = tuple(decode_value(v, "key") for v in json.loads(json.dumps(encode_key(key))))
    assert back == key
    assert [type(v) for v in back] == [type(v) for v in key]
    assert key_text(encode_key(back)) == key_text(encode_key(key))


def test_keys_match_on_type_as_well_as_value():
    texts = {key_text(encode_key(k)) for k in [(1,), (True,), (1.0,), ("1",), ((1,),), ([1],)]}
    assert len(texts) == 6


def test_a_key_value_a_file_cannot_hold_is_refused():
    with pytest.raises(TypeError, match="builtins.object"):
        encode_key((1, object()))


# --- the file


def test_the_file_reads_back_what_was_written_one_pick_per_line(tmp_path):
    doc = pin_doc({SCALE: [SCALE_128, {"key": [64, "torch.float32"], "config": cfg({"BLOCK": 32})}], NORM: [NORM_128]})
    path = write(tmp_path, doc)
    assert json.loads(path.read_text()) == doc
    assert sum('"key"' in line for line in path.read_text().splitlines()) == 3
    pins = load(path)
    assert (pins.gpu_name, pins.capability, pins.triton, pins.exllamav3, pins.strict) == ("NVIDIA H200", (9, 0), "3.6.0", "1.6.5", False)
    assert pins.picks == 3
    pick = pins.kernels[NORM][key_text(NORM_128["key"])]
    assert pick.key == (128, 1, "torch.bfloat16", "torch.bfloat16")
    assert pick.config == {**NORM_128["config"], "maxnreg": None}


def _set(doc, path, value):
    *head, last = path
    for p in head:
        doc = doc[p]
    if value is _DELETE:
        del doc[last]
    else:
        doc[last] = value


_DELETE = object()


@pytest.mark.parametrize("path, value, message", [
    (("gpu",), _DELETE, "gpu: expected an object, got null"),
    (("gpu", "capability"), "9.0", "gpu.capability: expected [major, minor]"),
    (("gpu", "name"), 90, "gpu.name"),
    (("format",), "triton-pins", "format: expected 'glm53-triton-pins'"),
    (("version",), 2, "version: this glm53 reads version 1"),
    (("triton",), _DELETE, "triton: expected a string, got null"),
    (("strict",), "yes", "strict: expected true or false"),
    (("kernels", SCALE, 0, "config", "num_warps"), "4", f"kernels[{SCALE!r}][0].config.num_warps: expected an integer >= 1"),
    (("kernels", SCALE, 0, "config", "num_stages"), _DELETE, f"kernels[{SCALE!r}][0].config.num_stages: missing"),
    (("kernels", SCALE, 0, "config", "kwargs"), [64], f"kernels[{SCALE!r}][0].config.kwargs: expected an object"),
    (("kernels", SCALE, 0, "config", "kwargs", "BLOCK"), [64], f"kernels[{SCALE!r}][0].config.kwargs.BLOCK"),
    (("kernels", SCALE, 0, "config", "num_wraps"), 4, f"kernels[{SCALE!r}][0].config.num_wraps: not a config field"),
    (("kernels", SCALE, 0, "key"), "128", f"kernels[{SCALE!r}][0].key: expected a list"),
    (("kernels", SCALE, 0, "key", 1), {"set": [1]}, f"kernels[{SCALE!r}][0].key[1]: " + '{"set": [1]} is not a key value'),
    (("kernels", SCALE, 0, "key", 1), {"dtype": "torch.nonsense"}, f"kernels[{SCALE!r}][0].key[1]"),
    (("kernels", SCALE), {"key": []}, f"kernels[{SCALE!r}]: expected a list of picks"),
])
def test_a_malformed_file_is_refused_naming_the_field(tmp_path, path, value, message):
    doc = pin_doc({SCALE: [json.loads(json.dumps(SCALE_128))]})
    _set(doc, path, value)
    file = tmp_path / "pins.json"
    file.write_text(json.dumps(doc))
    with pytest.raises(PinFileError) as err:
        load(file)
    assert str(err.value).startswith(f"{file}: ")
    assert message in str(err.value)


def test_a_file_that_is_not_json_or_names_kernels_badly_is_refused(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "glm53-triton-pins",\n "version": 1,,}')
    with pytest.raises(PinFileError, match=r"bad.json: not JSON: .* at line 2"):
        load(bad)
    doc = pin_doc({"scale_kernel": [SCALE_128]})
    with pytest.raises(PinFileError, match="a kernel is named 'module:function'"):
        load(write(tmp_path, doc))
    twice = pin_doc({SCALE: [SCALE_128, {**SCALE_128, "config": cfg({"BLOCK": 32})}]})
    with pytest.raises(PinFileError, match=r"\[1\]: key \[128,\"torch.float32\"\] is pinned twice"):
        load(write(tmp_path, twice))
    with pytest.raises(PinFileError, match="cannot read the pick file"):
        load(tmp_path / "absent.json")


def test_merge_keeps_the_old_picks_and_adds_new_keys(tmp_path):
    base = load(write(tmp_path, pin_doc({SCALE: [SCALE_128]})))
    new = {SCALE: [{**SCALE_128, "config": cfg({"BLOCK": 32})}, {"key": [256, "torch.float32"], "config": cfg({"BLOCK": 32})}],
           NORM: [NORM_128]}
    merged = merge(base, new)
    by_key = {key_text(e["key"]): e["config"] for e in merged[SCALE]}
    assert by_key == {key_text(SCALE_128["key"]): SCALE_128["config"], key_text([256, "torch.float32"]): cfg({"BLOCK": 32})}
    assert merged[NORM] == [NORM_128]


# --- installing


def test_a_pinned_key_is_never_benchmarked_and_uses_the_declared_config(kernels, tmp_path):
    path = write(tmp_path, pin_doc({SCALE: [SCALE_128]}))
    report = triton_pin.install(path)
    assert (report.loaded, report.kernels, report.pinned, report.unpinned) == (1, 1, 0, 0)
    for _ in range(3):
        chosen = run_scale(kernels, 128)
    assert kernels.scale_kernel.benchmarked == []
    assert chosen is kernels.SCALE_CONFIGS[2]  # BLOCK=64, num_warps=2: the kernel's own object
    assert {id(c) for _, c in kernels.scale_kernel.launched} == {id(chosen)}  # only the pinned config is compiled
    assert (report.pinned, report.unpinned) == (1, 0)
    assert triton_pin.report() is report


def test_a_key_not_in_the_file_is_tuned_as_usual_counted_and_logged_once(kernels, tmp_path, caplog):
    report = triton_pin.install(write(tmp_path, pin_doc({SCALE: [SCALE_128]})))
    with caplog.at_level(logging.WARNING, logger="glm53.engine.exl3.triton_pin"):
        run_scale(kernels, 256)
        run_scale(kernels, 256)
        run_norm(kernels)
    assert kernels.scale_kernel.benchmarked == [(256, "torch.float32")]
    assert report.unpinned_keys == [{"kernel": SCALE, "key": [256, "torch.float32"]},
                                    {"kernel": NORM, "key": [128, 1, "torch.bfloat16", "torch.bfloat16"]}]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2
    assert SCALE in warnings[0] and '[256, "torch.float32"]' in warnings[0] and "not in the pick file" in warnings[0]


@pytest.mark.parametrize("how", ["argument", "file"])
def test_strict_pins_raise_at_a_key_the_file_lacks(kernels, tmp_path, how):
    doc = pin_doc({SCALE: [SCALE_128]}, **({"strict": True} if how == "file" else {}))
    report = triton_pin.install(write(tmp_path, doc), **({"strict": True} if how == "argument" else {}))
    assert report.strict
    run_scale(kernels, 128)
    with pytest.raises(triton_pin.UnpinnedKey, match=rf'{SCALE}: autotune key \[256, "torch.float32"\] is not in the pick file .*\(strict\)'):
        run_scale(kernels, 256)
    assert kernels.scale_kernel.benchmarked == []


def test_the_argument_overrides_a_strict_file(kernels, tmp_path):
    report = triton_pin.install(write(tmp_path, pin_doc({SCALE: [SCALE_128]}, strict=True)), strict=False)
    run_scale(kernels, 256)
    assert report.unpinned == 1


def test_per_device_kind_kernels_are_made_and_checked_at_install(kernels, tmp_path):
    report = triton_pin.install(write(tmp_path, pin_doc({NORM: [NORM_128]})))
    tuners = kernels.norm_kernel.fn._tuners
    assert list(tuners) == [("NVIDIA H200", 9, 0)]  # made by install, before any launch
    assert isinstance(tuners[("NVIDIA H200", 9, 0)].cache, triton_pin.PinnedCache)
    assert run_norm(kernels).all_kwargs() == {"BT": 32, "num_warps": 1, "num_stages": 3, "num_ctas": 1}
    # a second device kind of the same capability gets its Autotuner at its first launch: pinned too
    fake_triton.CURRENT_KIND = ("NVIDIA H100", 9, 0)
    assert run_norm(kernels).all_kwargs()["BT"] == 32
    assert all(t.benchmarked == [] for t in tuners.values()) and len(tuners) == 2
    assert (report.pinned, report.unpinned) == (2, 0)


def test_a_file_from_another_gpu_architecture_is_refused(kernels, tmp_path, monkeypatch):
    path = write(tmp_path, pin_doc({SCALE: [SCALE_128]}))
    monkeypatch.setattr(triton_pin, "_visible_gpus", lambda: [(0, "NVIDIA H200", (9, 0)), (1, "NVIDIA GeForce RTX 4090", (8, 9))])
    with pytest.raises(ArchitectureMismatch) as err:
        triton_pin.install(path)
    for part in ("NVIDIA H200 (sm_90)", "cuda:1 is NVIDIA GeForce RTX 4090 (sm_89)", "glm53 triton-pin record"):
        assert part in str(err.value)
    monkeypatch.setattr(triton_pin, "_visible_gpus", list)
    with pytest.raises(ArchitectureMismatch, match="sees none"):
        triton_pin.install(path)
    assert triton_pin.report() is None


def test_another_exllamav3_or_a_file_recorded_by_another_build_is_refused(kernels, tmp_path, monkeypatch):
    path = write(tmp_path, pin_doc({SCALE: [SCALE_128]}))  # recorded with triton 3.6.0 and exllamav3 1.6.5
    monkeypatch.setattr(triton_pin, "runtime_versions", lambda: {"triton": "3.6.0", "exllamav3": "1.6.6", "torch": None})
    for pins in (path, None):  # the patch points are exllamav3 1.6.5's, with or without a file
        with pytest.raises(InternalsChanged, match="exllamav3 1.6.5's kernels; exllamav3 1.6.6 is installed"):
            triton_pin.install(pins)
    monkeypatch.setattr(triton_pin, "runtime_versions", lambda: {"triton": "3.7.0", "exllamav3": "1.6.5", "torch": None})
    with pytest.raises(VersionMismatch, match=r"recorded with triton 3\.6\.0, but triton 3\.7\.0 is running; record"):
        triton_pin.install(path)
    assert triton_pin.report() is None


def test_a_pin_that_is_not_a_declared_config_is_refused_and_nothing_is_installed(kernels, tmp_path):
    original = fake_triton.FakeAutotuner.run
    doc = pin_doc({SCALE: [{**SCALE_128, "config": cfg({"BLOCK": 128}, num_warps=2)}]})
    with pytest.raises(PinFileError, match=rf"kernels\['{SCALE}'\]: the pinned config BLOCK=128, num_warps=2.* is not one of the kernel's 4 declared"):
        triton_pin.install(write(tmp_path, doc))
    assert triton_pin.report() is None and fake_triton.FakeAutotuner.run is original


def test_a_kernel_this_exllamav3_lacks_is_refused(kernels, tmp_path):
    for kernel, message in [("tests.engine.exl3.fake_kernels:gone_kernel", "fake_kernels has no gone_kernel"),
                            ("tests.engine.exl3.no_such_module:k", "cannot import tests.engine.exl3.no_such_module"),
                            ("tests.engine.exl3.fake_kernels:SCALE_CONFIGS", None)]:
        doc = pin_doc({kernel: [SCALE_128]})
        if message is None:
            with pytest.raises(InternalsChanged, match="is not a triton.autotune kernel"):
                triton_pin.install(write(tmp_path, doc))
        else:
            with pytest.raises(PinFileError, match=message):
                triton_pin.install(write(tmp_path, doc))


def test_uninstall_gives_triton_its_run_back(kernels, tmp_path):
    original = fake_triton.FakeAutotuner.run
    triton_pin.install(write(tmp_path, pin_doc({SCALE: [SCALE_128]})))
    assert fake_triton.FakeAutotuner.run is not original
    triton_pin.install(write(tmp_path, pin_doc({NORM: [NORM_128]})))  # installing again does not wrap twice
    assert fake_triton.FakeAutotuner.run.__wrapped__ is original
    triton_pin.uninstall()
    assert fake_triton.FakeAutotuner.run is original and type(kernels.scale_kernel.cache) is dict
    run_scale(kernels, 128)
    assert kernels.scale_kernel.benchmarked == [(128, "torch.float32")]


class LoadReached(Exception):
    """Raised by a stand-in for exllamav3's load: the backend got that far."""


def reach_load(model_dir, **sizes):
    raise LoadReached


def test_the_backend_pins_glm53_triton_pin_before_it_loads_the_model(kernels, tmp_path, monkeypatch):
    """GLM53_TRITON_PIN is in force when exllamav3's load (and its warm-up's first KDA launches) begins."""
    path = write(tmp_path, pin_doc({SCALE: [SCALE_128], NORM: [NORM_128]}))
    seen = []

    def load(model_dir, **sizes):
        seen.append(triton_pin.report().as_dict())
        seen.append(run_scale(kernels, 128))  # a launch during the load is answered from the file
        raise LoadReached

    monkeypatch.setattr(backend.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(backend, "load", load)
    settings = config.load(["--engine", "exl3", "-m", str(tmp_path), "--triton-pin", str(path)], {})
    with pytest.raises(LoadReached):
        backend.Exl3Backend(settings)
    assert seen[0] == {"file": str(path), "strict": False, "loaded": 2, "kernels": 2, "pinned": 0, "unpinned": 0, "unpinned_keys": []}
    assert seen[1] is kernels.SCALE_CONFIGS[2] and kernels.scale_kernel.benchmarked == []
    assert triton_pin.report().pinned == 1


def test_without_glm53_triton_pin_the_backend_leaves_triton_alone(kernels, tmp_path, monkeypatch):
    original = fake_triton.FakeAutotuner.run
    monkeypatch.setattr(backend.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(backend, "load", reach_load)
    with pytest.raises(LoadReached):
        backend.Exl3Backend(config.load(["--engine", "exl3", "-m", str(tmp_path)], {}))
    assert triton_pin.report() is None and fake_triton.FakeAutotuner.run is original


def test_picks_recorded_in_one_process_are_used_in_the_next(kernels, tmp_path, monkeypatch):
    """Recording (install without a file, run, collect) then a fresh set of kernels whose timings differ."""
    from tests.engine.exl3 import fake_kernels

    report = triton_pin.install(None)
    chosen = {n: run_scale(kernels, n) for n in (128, 256)}
    chosen["norm"] = run_norm(kernels, nb=2)
    assert report.unpinned == 3 and report.file is None
    path = write(tmp_path, pin_doc(triton_pin.collect()))
    triton_pin.uninstall()

    fresh = importlib.reload(fake_kernels)
    monkeypatch.setattr(fake_triton.FakeAutotuner, "winner", 3)  # another process, other timings
    report = triton_pin.install(path, strict=True)
    again = {n: run_scale(fresh, n) for n in (128, 256)}
    again["norm"] = run_norm(fresh, nb=2)
    assert {k: c.all_kwargs() for k, c in again.items()} == {k: c.all_kwargs() for k, c in chosen.items()}
    assert fresh.scale_kernel.benchmarked == [] and (report.pinned, report.unpinned) == (3, 0)


def test_show_prints_the_picks_and_names_a_bad_field(tmp_path, capsys):
    path = write(tmp_path, pin_doc({SCALE: [SCALE_128], NORM: [NORM_128]}))
    assert cli.main(["triton-pin", "show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "2 picks for 2 kernels, recorded on NVIDIA H200 (sm_90) with triton 3.6.0, exllamav3 1.6.5" in out
    assert '[128,"torch.float32"] -> BLOCK=64, num_warps=2, num_stages=3, num_ctas=1' in out
    doc = pin_doc({SCALE: [SCALE_128]})
    doc["gpu"]["capability"] = [9]
    assert cli.main(["triton-pin", "show", str(write(tmp_path, doc, "bad.json"))]) == 1
    assert "gpu.capability" in capsys.readouterr().err


def test_record_refuses_bad_lengths_before_loading_anything(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["triton-pin", "record", "-m", "x", "--out", "y", "--lengths", "12,abc"])
    assert "expected comma-separated token counts" in capsys.readouterr().err
    out = tmp_path / "pins.json"
    assert cli.main(["triton-pin", "record", "-m", str(tmp_path), "--out", str(out), "--lengths", "600,5000", "--cache-size", "4096"]) == 1
    assert "prompt length 5000 does not fit the cache of 4096 tokens" in capsys.readouterr().err and not out.exists()


def test_record_writes_every_pick_its_workload_made_and_merge_keeps_the_old_ones(kernels, tmp_path, monkeypatch, capsys):
    """``glm53 triton-pin record`` with the model's passes replaced by launches of the stand-in kernels."""
    for name, value in [("is_available", lambda: True), ("current_device", lambda: 0),
                        ("get_device_name", lambda d=None: "NVIDIA H200"), ("get_device_capability", lambda d=None: (9, 0))]:
        monkeypatch.setattr(torch.cuda, name, value)

    class Closable:
        def close(self):
            pass

        unload = close

    monkeypatch.setattr(triton_pin_record, "load_stock", lambda model_dir, **sizes: SimpleNamespace(model=Closable(), generator=Closable(), vocab_size=50))
    monkeypatch.setattr(triton_pin_record, "forward_nc", lambda model, ids: run_scale(kernels, len(ids)))
    monkeypatch.setattr(triton_pin_record, "generate", lambda gen, prompts, n: [run_norm(kernels, nb=1 + len(p) // 1000) for p in prompts])
    out = tmp_path / "pins.json"
    args = ["triton-pin", "record", "-m", str(tmp_path), "--out", str(out), "--chunk-size", "1024", "--cache-size", "4096", "--ambs", "2"]
    assert cli.main([*args, "--lengths", "64,1500"]) == 0  # 1500 > the chunk: no cache-less forward
    doc = json.loads(out.read_text())
    assert {k: [e["key"][:2] for e in v] for k, v in doc["kernels"].items()} == {NORM: [[128, 1], [128, 2]], SCALE: [[64, "torch.float32"]]}
    assert doc["gpu"] == {"name": "NVIDIA H200", "capability": [9, 0]} and doc["recorded"]["lengths"] == [64, 1500]
    assert triton_pin.report() is None  # recording leaves nothing installed

    assert cli.main([*args, "--lengths", "128", "--merge"]) == 0
    merged = json.loads(out.read_text())["kernels"]
    assert [e["key"][0] for e in merged[SCALE]] == [128, 64]  # sorted on the key's text
    assert merged[NORM] == doc["kernels"][NORM]
    assert "wrote " in capsys.readouterr().out


# --- a real Triton


def test_a_real_triton_autotuner_answers_from_the_pins_without_a_gpu(tmp_path, monkeypatch):
    pytest.importorskip("triton", reason="Triton is not installed here (the CPU test venv has none; the GPU machine has)")
    from triton.runtime.autotuner import Autotuner

    from tests.engine.exl3 import triton_kernels

    importlib.reload(triton_kernels)
    monkeypatch.setattr(triton_pin, "_visible_gpus", lambda: H200)
    monkeypatch.setattr(triton_pin, "runtime_versions", lambda: {"triton": "3.6.0", "exllamav3": "1.6.5", "torch": None})  # the file's
    kernel = "tests.engine.exl3.triton_kernels:add_one_kernel"
    path = write(tmp_path, pin_doc({kernel: [SCALE_128]}))
    original = Autotuner.run
    launches = []

    class Launcher:  # stands in for the JITFunction: records what the Autotuner would launch
        def run(self, *args, **kwargs):
            launches.append(kwargs)

    try:
        report = triton_pin.install(path)
        tuner = triton_kernels.add_one_kernel
        assert isinstance(tuner.cache, triton_pin.PinnedCache) and Autotuner.run is not original
        tuner.fn = Launcher()
        x = torch.zeros(128)
        tuner.run(x, 128, grid=(1,), warmup=False)
        assert {k: launches[0][k] for k in ("BLOCK", "num_warps", "num_stages")} == {"BLOCK": 64, "num_warps": 2, "num_stages": 3}
        assert (report.pinned, report.unpinned) == (1, 0)
        triton_pin.install(path, strict=True)
        with pytest.raises(triton_pin.UnpinnedKey, match=r'\[256, "torch.float32"\]'):
            tuner.run(x, 256, grid=(1,), warmup=False)
    finally:
        triton_pin.uninstall()
    assert Autotuner.run is original
