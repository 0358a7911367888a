"""The eval tier's verdict on what `nix eval` printed: every warning must be one the project raises on purpose.

nix/ci/eval.nix returns, for each NixOS configuration it evaluates, the warnings that configuration raises on purpose
(it has already thrown if a configuration raised any other). Nix prints each of those as it evaluates the toplevel;
anything else on the evaluation's stderr (a nixpkgs deprecation, a `builtins.trace`, a warning of Nix's own) fails.

    python3 nix/ci/eval_warnings.py EVAL.json EVAL.stderr

On success prints one line: how many derivations evaluated, and which warnings were raised on purpose.
"""

from __future__ import annotations

import json
import sys

# What Nix writes before a message; a message's further lines are indented by the prefix's width.
PREFIXES = ("evaluation warning: ", "warning: ", "trace: ")


def messages(stderr: str) -> list[str]:
    """Each message on stderr, its lines joined; a line outside any message is a message of its own."""
    found: list[list[str]] = []
    indent = None
    for line in stderr.splitlines():
        prefix = next((p for p in PREFIXES if line.startswith(p)), None)
        if prefix is not None:
            found.append([line[len(prefix):]])
            indent = " " * len(prefix)
        elif indent is not None and line.startswith(indent):
            found[-1].append(line[len(indent):])
        elif line.strip():
            found.append([line])
            indent = None
    return ["\n".join(lines).strip() for lines in found]


def derivations(value) -> set[str]:
    """Every derivation path in a JSON value."""
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        return set().union(set(), *map(derivations, value))
    return {value} if isinstance(value, str) and value.endswith(".drv") else set()


def main(argv: list[str]) -> int:
    with open(argv[1]) as f:
        result = json.load(f)
    with open(argv[2]) as f:
        printed = messages(f.read())
    configurations = result.pop("configurations")
    result.pop("wheels")  # what autoPatchelf is given, for the wheels tier
    on_purpose = {w.strip() for c in configurations.values() for w in c["warnings"]}
    unexpected = [m for m in printed if m not in on_purpose]
    if unexpected:
        print("printed while evaluating, and not raised by the project on purpose:", file=sys.stderr)
        for m in unexpected:
            print("  " + m.replace("\n", "\n  "), file=sys.stderr)
        return 1
    drvs = derivations(result) | {c["toplevel"] for c in configurations.values()}
    outputs = ", ".join(f"{len(v)} {k}" for k, v in sorted(result.items()))
    raised = "; ".join(f"{name}: {', '.join(c['onPurpose'])}" for name, c in sorted(configurations.items()) if c["onPurpose"])
    print(f"{len(drvs)} derivations evaluate, none built ({outputs}; NixOS {', '.join(sorted(configurations))}); "
          f"no warning but those raised on purpose ({raised})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
