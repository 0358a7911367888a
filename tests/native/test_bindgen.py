"""The bindings generated from the native headers (``glm53.native.bindgen``): the checked-in files are what the
headers give now, and a header in the subset becomes a Python binding and an ABI table that agree once compiled
(a small library built here with g++)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from types import ModuleType

import pytest

from glm53.native import abi, bindgen

HEADER = """/* a library's header, as the project writes them */
#ifndef DEMO_H
#define DEMO_H
#include <stdint.h>
#ifdef __cplusplus
extern "C" {
#endif
#define DEMO_API __attribute__((visibility("default")))
#define DEMO_LIMIT (2 * 8)  // rows
enum demo_state { DEMO_IDLE = 0, DEMO_BUSY, DEMO_DONE = DEMO_BUSY + 0x2, DEMO_COUNT };
enum { DEMO_ERROR = -3 };
typedef struct demo_pair { int32_t a, *b; double c; } demo_pair;
struct DemoBox {
    demo_pair pair;        /* by value */
    const char* label;
    uint8_t bytes[3];
};
typedef struct demo_handle demo_handle;
DEMO_API int32_t demo_abi(const char* name, int64_t* value);
DEMO_API const char* demo_name(const DemoBox* box, const char* const* names, demo_handle* handle);
DEMO_API void demo_reset(void);
#ifdef __cplusplus
}
#endif
#endif
"""


def test_the_checked_in_bindings_are_what_the_headers_give():
    assert bindgen.stale() == [], "run `make bindings` (python -m glm53.native.bindgen) and commit what it writes"


def test_a_header_becomes_constants_structs_and_signatures():
    header = bindgen.parse(HEADER, "demo.h")
    assert list(header.constants.items()) == [("DEMO_LIMIT", 16), ("DEMO_IDLE", 0), ("DEMO_BUSY", 1), ("DEMO_DONE", 3),
                                              ("DEMO_COUNT", 4), ("DEMO_ERROR", -3)]
    assert header.enums == {"demo_state": {"DEMO_IDLE": 0, "DEMO_BUSY": 1, "DEMO_DONE": 3, "DEMO_COUNT": 4}}
    assert header.structs["demo_pair"] == [("a", bindgen.CType("int32_t")), ("b", bindgen.CType("int32_t", 1)),
                                           ("c", bindgen.CType("double"))]
    assert header.opaque == ["demo_handle"] and [f.name for f in header.functions] == ["demo_abi", "demo_name", "demo_reset"]
    binding = _module(bindgen.python_module([header]))
    assert [(n, t) for n, t in binding.DemoBox._fields_] == [("pair", binding.demo_pair), ("label", ctypes.c_char_p),
                                                            ("bytes", ctypes.c_uint8 * 3)]
    restype, argtypes = binding.FUNCTIONS["demo_name"]
    assert restype is ctypes.c_char_p and argtypes[0]._type_ is binding.DemoBox
    assert argtypes[1:] == [ctypes.POINTER(ctypes.c_char_p), ctypes.c_void_p] and binding.FUNCTIONS["demo_reset"] == (None, [])
    assert binding.ABI["demo_abi"][1]["DEMO_DONE"] == 3 and set(binding.ABI["demo_abi"][0]) == {"demo_pair", "DemoBox"}


def test_the_generated_table_and_binding_agree_once_compiled(tmp_path):
    """The header, the ABI table generated from it and a source that includes both, built with g++: the binding the
    same header gives binds to the library, every size, offset and number checked."""
    header = bindgen.parse(HEADER, "demo.h")
    (tmp_path / "demo.h").write_text(HEADER)
    (tmp_path / "demo_abi.inc").write_text(bindgen.abi_include(header))
    (tmp_path / "demo.cpp").write_text('#include "demo.h"\n#include "abi.h"\n#include "demo_abi.inc"\n'
                                       'const char* demo_name(const DemoBox*, const char* const* names, demo_handle*) '
                                       '{ return names[1]; }\nvoid demo_reset(void) {}\n')
    shutil.copy(bindgen.ROOT / "native" / "abi.h", tmp_path / "abi.h")
    subprocess.run(["g++", "-shared", "-fPIC", "-o", str(tmp_path / "libdemo.so"), str(tmp_path / "demo.cpp")], check=True)
    lib = abi.bind(ctypes.CDLL(str(tmp_path / "libdemo.so")), tmp_path / "libdemo.so",
                   _module(bindgen.python_module([header])))
    assert abi.lookup(lib.demo_abi)("DemoBox.bytes") == 32 and abi.lookup(lib.demo_abi)("DEMO_ERROR") == -3
    names = (ctypes.c_char_p * 2)(b"first", b"second")
    assert lib.demo_name(None, names, None) == b"second"


@pytest.mark.parametrize(("text", "message"), [
    ("struct S { float128 x; };", "^demo.h: x: unknown type 'float128'$"),
    ("enum { A = B + 1 };", "'B \\+ 1' is not an integer constant expression of known names"),
    ("#define WIDTH sizeof(int)\n", "demo.h: '#define WIDTH sizeof\\(int\\)': 'sizeof\\(int\\)' is not an integer constant"),
    ("union U { int a; float b; };", "not an enum, struct, #define or prototype"),
    ("int f(int);", "^demo.h: 'int f\\(int\\)': parameter 'int': 'int' needs a type and a name$"),
    ("struct S { int a; }; int s_abi(const char* name, int64_t* value); int t_abi(const char* name, int64_t* value);",
     "more than one \\*_abi function: s_abi, t_abi"),
    ("struct S { int a; };", "declares structs or numbers but no <prefix>_abi"),
    ("typedef struct h h; struct S { h inner; };", "^demo.h: inner: unknown type 'h' by value$"),
    ("void f(int rows[4]);", "^demo.h: f: an array parameter \\(write it as the pointer it is\\)$"),
])
def test_what_the_generator_does_not_read_is_refused_by_name(text, message):
    with pytest.raises(bindgen.HeaderError, match=message):
        bindgen.python_module([bindgen.parse(text, "demo.h")])


def _module(source: str) -> ModuleType:
    module = ModuleType("demo_binding")
    exec(compile(source, "demo_binding.py", "exec"), module.__dict__)  # noqa: S102 (the generator's own output)
    return module
