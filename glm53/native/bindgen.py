"""The bindings of the native libraries, generated from their C headers so that no struct, signature or number is
written twice by hand. Per library, from its headers (:data:`LIBRARIES`):

- a Python module (``glm53/native/<library>_binding.py``): each struct as a ``ctypes.Structure``, each number
  (``#define`` and enum member) as a constant, each tagged enum as a ``{member: value}`` dict, ``FUNCTIONS`` (every
  prototype's ``restype`` and ``argtypes``) and ``ABI`` (what each ``<prefix>_abi`` must report);
- per header, the definition of its ``<prefix>_abi`` (``<header>_abi.inc`` beside it, ``../abi.h``'s lookup over the
  ``sizeof`` and ``offsetof`` of every struct the header defines and every number it declares), which the library's
  source includes: the compiler, not this script, fills in the values that the loader checks the mirrors against.

Both are checked in (the CPU library builds with plain g++ and the CUDA one with nvcc, with no generator in
either build); ``python -m glm53.native.bindgen`` (``make bindings``) writes them again after a header changed,
and a test fails while they are out of step.

The headers use a small subset of C, which :func:`parse` refuses to guess beyond, naming the file and the
declaration: ``#define NAME <integer expression>`` (or an ``__attribute__`` macro, dropped from prototypes);
``enum [tag] { A = <expression>, B, ... };``; ``struct S { fields };``, ``typedef struct s { fields } s;`` and the
opaque ``typedef struct s s;``; prototypes with named parameters. In signatures ``const char*`` is a string
(``c_char_p``), ``const char* const*`` an array of them, a pointer to a struct of the headers a pointer of its
type, any other pointer an address (``c_void_p``, also every pointer field of a struct). Standard library only.
"""

from __future__ import annotations

import ast
import operator
import re
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIBRARIES = {  # generated module -> its headers, in include order
    "glm53/native/cpu_binding.py": ("native/cpu_expert/cpu_expert.h", "native/cpu_tier/cpu_tier.h", "native/disk/disk_reader.h"),
    "glm53/native/cuda_binding.py": ("native/ec/expert_cache.h",),
}
SCALARS = {
    "int8_t": "c_int8", "uint8_t": "c_uint8", "int16_t": "c_int16", "uint16_t": "c_uint16", "int32_t": "c_int32",
    "uint32_t": "c_uint32", "int64_t": "c_int64", "uint64_t": "c_uint64", "int": "c_int", "unsigned int": "c_uint",
    "long long": "c_longlong", "unsigned long long": "c_ulonglong", "size_t": "c_size_t", "float": "c_float",
    "double": "c_double", "char": "c_char", "bool": "c_bool", "cudaStream_t": "c_void_p",
}
_QUALIFIERS = {"const", "volatile", "struct", "enum"}
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
              ast.LShift: operator.lshift, ast.RShift: operator.rshift, ast.BitOr: operator.or_,
              ast.BitAnd: operator.and_, ast.BitXor: operator.xor}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Invert: operator.invert}


class HeaderError(ValueError):
    """A header declaration outside the subset the generator reads; the message names the file and the text."""


@dataclass(frozen=True)
class CType:
    """A declared type: its base type's name (``"unsigned int"``, ``"glm53_ce_linear"``), the number of ``*`` and
    whether the base is const; ``count`` for an array field (``int32_t x[4]``)."""

    base: str
    pointers: int = 0
    const: bool = False
    count: int | None = None


@dataclass
class Function:
    name: str
    restype: CType
    params: list[tuple[str, CType]]
    text: str  # the prototype as written, without its attribute macro


@dataclass
class Header:
    path: str
    constants: dict[str, int] = field(default_factory=dict)  # in declaration order
    enums: dict[str, dict[str, int]] = field(default_factory=dict)  # tag -> members
    structs: dict[str, list[tuple[str, CType]]] = field(default_factory=dict)
    opaque: list[str] = field(default_factory=list)
    functions: list[Function] = field(default_factory=list)


def evaluate(expression: str, constants: dict[str, int], where: str) -> int:
    """An integer constant expression of C (literals, known names, ``+ - * / << >> | & ^ ~`` and parentheses)."""
    text = re.sub(r"\b(0x[0-9a-fA-F]+|\d+)[uUlL]+\b", r"\1", expression.strip()).replace("/", "//")

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.Name) and node.id in constants:
            return constants[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        raise HeaderError(f"{where}: {expression.strip()!r} is not an integer constant expression of known names")

    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise HeaderError(f"{where}: {expression.strip()!r} is not an integer constant expression") from None
    return value(tree.body)


def _declarator(tokens: list[str], where: str) -> tuple[str, CType]:
    """``(name, type)`` of one declaration such as ``const int64_t* home`` or ``uint32_t slots``."""
    count = None
    if len(tokens) >= 4 and tokens[-1] == "]" and tokens[-3] == "[":
        count, tokens = int(tokens[-2]), tokens[:-3]
    if not tokens or not re.fullmatch(r"[A-Za-z_]\w*", tokens[-1]) or tokens[-1] in _QUALIFIERS:
        raise HeaderError(f"{where}: {' '.join(tokens)!r} declares no name")
    *typed, name = tokens
    const = bool(typed) and typed[0] == "const"
    words = [t for t in typed if t not in _QUALIFIERS and t != "*"]
    pointers = typed.count("*")
    if "*" in typed and any(t not in ("*", "const") for t in typed[typed.index("*"):]):
        raise HeaderError(f"{where}: {' '.join(tokens)!r}: nothing but const may follow a *")
    if not words:
        raise HeaderError(f"{where}: {' '.join(tokens)!r} needs a type and a name")
    return name, CType(" ".join(words), pointers, const, count)


def _tokens(text: str) -> list[str]:
    return re.findall(r"[A-Za-z_]\w*|\d+|[*,\[\]()]", text)


def _fields(body: str, where: str) -> list[tuple[str, CType]]:
    fields = []
    for member in filter(None, (m.strip() for m in body.split(";"))):
        first, *more = " ".join(_tokens(member)).split(",")
        name, ctype = _declarator(first.split(), f"{where}: {member!r}")
        fields.append((name, ctype))
        for other in more:  # uint32_t magic, version: the base type again, with the declarator's own stars
            words = other.split()
            if len(words) != words.count("*") + 1:
                raise HeaderError(f"{where}: {member!r}: a second declarator is a name with stars only")
            fields.append((words[-1], CType(ctype.base, words.count("*"), ctype.const)))
    return fields


def _statements(text: str) -> list[str]:
    """The top-level declarations, without ``extern "C" {`` and its closing brace."""
    text = re.sub(r'extern\s+"C"\s*\{', " ", text)
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "{":
            depth += 1
        elif ch == "}":
            if depth == 0:  # closes an extern "C" block
                text = text[:i] + " " + text[i + 1:]
            else:
                depth -= 1
        elif ch == ";" and depth == 0:
            out.append(text[start:i].strip())
            start = i + 1
    if text[start:].strip():
        raise HeaderError(f"a declaration without its ';': {text[start:].strip()[:80]!r}")
    return [s for s in out if s]


def parse(text: str, path: str, known: Header | None = None) -> Header:
    """The declarations of one header. ``known``: what the headers included before it declare (their structs and
    constants may be used here).

    :raise HeaderError: a declaration outside the subset the module's docstring lists.
    """
    header = Header(path)
    constants = dict(known.constants) if known else {}
    body, attributes = _preprocess(text)
    for statement in _statements(body):
        shown = " ".join(statement.split()).replace("__define ", "#define ", 1)[:100]
        _declaration(statement, f"{path}: {shown!r}", header, constants, attributes)
    by_value = {*SCALARS, *header.structs, *(known.structs if known else ())}  # an opaque struct only behind a *
    by_pointer = {*by_value, "void", *header.opaque, *(known.opaque if known else ())}
    declared = [f for fs in header.structs.values() for f in fs] + [p for fn in header.functions for p in fn.params]
    declared += [("return", fn.restype) for fn in header.functions if fn.restype != CType("void")]
    for name, ctype in declared:
        if ctype.base not in (by_pointer if ctype.pointers else by_value):
            raise HeaderError(f"{path}: {name}: unknown type {ctype.base!r}{' by value' if ctype.base in by_pointer else ''}")
    for fn in header.functions:
        if any(t.count is not None for _, t in fn.params):
            raise HeaderError(f"{path}: {fn.name}: an array parameter (write it as the pointer it is)")
    return header


def _preprocess(text: str) -> tuple[str, list[str]]:
    """The header without comments and preprocessor lines, but each numeric ``#define`` kept in its place as a
    statement ``__define NAME VALUE;``, and the names of its attribute macros."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.DOTALL)
    text = re.sub(r"//[^\n]*", "", text).replace("\\\n", " ")
    body, attributes = [], []
    for line in text.splitlines():
        if not line.lstrip().startswith("#"):
            body.append(line)
            continue
        define = re.match(r"\s*#\s*define\s+([A-Za-z_]\w*)(\s+.*)?$", line)
        if not define or not (define[2] or "").strip():
            continue  # include guards, #include, #ifdef
        name, value = define[1], define[2].strip()
        if value.startswith("__attribute__"):
            attributes.append(name)
        else:
            body.append(f"__define {name} {value};")
    return "\n".join(body), attributes


def _declaration(statement: str, where: str, header: Header, constants: dict[str, int], attributes: list[str]) -> None:
    """One top-level declaration into ``header``."""
    if m := re.fullmatch(r"__define ([A-Za-z_]\w*) (.*)", statement, re.DOTALL):
        constants[m[1]] = header.constants[m[1]] = evaluate(m[2], constants, where)
    elif m := re.fullmatch(r"enum\s*([A-Za-z_]\w*)?\s*\{(.*)\}", statement, re.DOTALL):
        members, previous = {}, -1
        for item in filter(None, (x.strip() for x in m[2].split(","))):
            name, _, expr = (x.strip() for x in item.partition("="))
            previous = evaluate(expr, constants, where) if expr else previous + 1
            constants[name] = header.constants[name] = members[name] = previous
        if m[1]:
            header.enums[m[1]] = members
    elif m := re.fullmatch(r"(?:typedef\s+)?struct\s+([A-Za-z_]\w*)\s*\{(.*)\}\s*([A-Za-z_]\w*)?", statement, re.DOTALL):
        if m[3] and m[3] != m[1]:
            raise HeaderError(f"{where}: a typedef'd struct must be named as its tag")
        header.structs[m[1]] = _fields(m[2], where)
    elif m := re.fullmatch(r"typedef\s+struct\s+([A-Za-z_]\w*)\s+([A-Za-z_]\w*)", statement):
        header.opaque.append(m[2])
    elif "(" in statement:
        prototype = " ".join(w for w in statement.split() if w not in attributes)
        m = re.fullmatch(r"(.*?)\(([^()]*)\)", prototype)
        if not m:
            raise HeaderError(f"{where}: not a prototype")
        name, restype = _declarator([t for t in _tokens(m[1]) if t != ","], where)
        params = [] if m[2].strip() in ("", "void") else \
            [_declarator(_tokens(p), f"{where}: parameter {p.strip()!r}") for p in m[2].split(",")]
        header.functions.append(Function(name, restype, params, prototype))
    else:
        raise HeaderError(f"{where}: not an enum, struct, #define or prototype")


def ctypes_type(ctype: CType, structs: set[str], role: str) -> str:
    """The ctypes expression of a type, as ``role`` ("field", "param" or "return") uses it."""
    if ctype.pointers == 0:
        if ctype.base == "void":
            return "None"
        base = ctype.base if ctype.base in structs else f"ctypes.{SCALARS[ctype.base]}"
        return f"({base} * {ctype.count})" if ctype.count is not None else base
    if ctype.base == "char" and ctype.const and ctype.pointers == 1:
        return "ctypes.c_char_p"
    if role == "param" and ctype.base == "char" and ctype.const and ctype.pointers == 2:
        return "ctypes.POINTER(ctypes.c_char_p)"
    if role == "param" and ctype.base in structs and ctype.pointers == 1:
        return f"ctypes.POINTER({ctype.base})"
    return "ctypes.c_void_p"


def python_module(headers: list[Header]) -> str:
    """The text of the Python binding of a library of ``headers`` (in include order)."""
    structs = {s for h in headers for s in h.structs}
    sources = ", ".join(h.path for h in headers)
    out = [f'"""The ctypes declarations of {", ".join(Path(h.path).name for h in headers)}: generated from them by',
           "``python -m glm53.native.bindgen`` (``make bindings``); do not edit. A test checks that it is in step, and",
           '``glm53.native.abi.bind`` checks it against the loaded library."""', "",
           "import ctypes"]
    for h in headers:
        out += ["", "", f"# ---- {h.path}", ""]
        out += [f"{name} = {value}" for name, value in h.constants.items()]
        for tag, members in h.enums.items():
            out += ["", f"{tag} = {{", *(f'    "{n}": {v},' for n, v in members.items()), "}"]
        for name, fields in h.structs.items():
            out += ["", "", f"class {name}(ctypes.Structure):", "    _fields_ = ["]
            out += [f'        ("{f}", {ctypes_type(t, structs, "field")}),' for f, t in fields]
            out += ["    ]"]
    out += ["", "", f"# restype and argtypes of every prototype of {sources}", "FUNCTIONS = {"]
    for h in headers:
        for fn in h.functions:
            argtypes = ", ".join(ctypes_type(t, structs, "param") for _, t in fn.params)
            entry = f'    "{fn.name}": ({ctypes_type(fn.restype, structs, "return")}, ['
            out += [f"    # {fn.text}"]
            if len(entry) + len(argtypes) + 3 <= 120:
                out += [f"{entry}{argtypes}]),"]
            else:
                out += [entry, *textwrap.wrap(argtypes, 120, initial_indent=" " * 8, subsequent_indent=" " * 8,
                                              break_long_words=False, break_on_hyphens=False), "    ]),"]
    out += ["}", "", "# what each <prefix>_abi reports: the structs of its header, by name, and the header's numbers", "ABI = {"]
    for h in headers:
        abi = _abi_function(h)
        if abi is None:
            continue
        out += [f'    "{abi.name}": (', "        {", *(f'            "{s}": {s},' for s in h.structs), "        },",
                "        {", *(f'            "{c}": {c},' for c in h.constants), "        },", "    ),"]
    out += ["}", ""]
    return "\n".join(out)


def _abi_function(header: Header) -> Function | None:
    found = [fn for fn in header.functions if fn.name.endswith("_abi")]
    if len(found) > 1:
        raise HeaderError(f"{header.path}: more than one *_abi function: {', '.join(f.name for f in found)}")
    if not found and (header.structs or header.constants):
        raise HeaderError(f"{header.path} declares structs or numbers but no <prefix>_abi(name, &value) to report them")
    return found[0] if found else None


def abi_include(header: Header) -> str:
    """The C definition of the header's ``<prefix>_abi``."""
    abi = _abi_function(header)
    assert abi is not None
    name, value = (p for p, _ in abi.params)
    entries = [e for s, fields in header.structs.items()
               for e in [f"GLM53_ABI_SIZE({s})", *(f"GLM53_ABI_FIELD({s}, {f})" for f, _ in fields)]]
    entries += [f"GLM53_ABI_CONSTANT({c})" for c in header.constants]
    return "\n".join([
        f"/* Generated from {Path(header.path).name} by glm53/native/bindgen.py (make bindings); do not edit. {abi.name}:",
        f" * the sizes and field offsets of {Path(header.path).name}'s structs and its numbers, by name (../abi.h). */",
        abi.text.replace(f"{abi.name} (", f"{abi.name}("),
        "{",
        "    static const glm53_abi_entry table[] = {",
        *(f"        {e}," for e in entries),
        "    };",
        f"    return {value} ? glm53_abi_lookup(table, sizeof(table) / sizeof(table[0]), {name}, {value}) : -1;",
        "}",
        "",
    ])


def generate(root: Path = ROOT) -> dict[Path, str]:
    """Every generated file's path and text, from the headers under ``root``.

    :raise HeaderError: a header the generator cannot read.
    """
    files: dict[Path, str] = {}
    for target, paths in LIBRARIES.items():
        headers: list[Header] = []
        known = Header("")
        for path in paths:
            header = parse((root / path).read_text(), path, known)
            headers.append(header)
            known.constants.update(header.constants)
            known.structs.update(header.structs)
            known.opaque += header.opaque
            if _abi_function(header) is not None:
                files[root / path.replace(".h", "_abi.inc")] = abi_include(header)
        files[root / target] = python_module(headers)
    return files


def stale(root: Path = ROOT) -> list[Path]:
    """The generated files that differ from what the headers give now (or are missing)."""
    return [p for p, text in generate(root).items() if not p.is_file() or p.read_text() != text]


def main(argv: list[str]) -> int:
    """``python -m glm53.native.bindgen`` writes the files; ``--check`` only lists the stale ones (exit 1 if any)."""
    if argv == ["--check"]:
        found = stale()
        for p in found:
            print(f"{p.relative_to(ROOT)} is out of step with its header: run `make bindings`", file=sys.stderr)
        return 1 if found else 0
    for path, text in generate().items():
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
