"""Every setting of the server, in one place.

Each field of :class:`Settings` carries its environment variable, its command-line flags, its parser (which
also says what is accepted), its default per mode and a one-line meaning. Values come from, lowest to highest
precedence: the mode's defaults, ``GLM53_*`` environment variables, command-line flags (for a flag given twice
the last one wins, so arguments appended to a command override earlier ones). The README's configuration table
and ``/server_info`` are generated from these definitions. Nothing else in the project reads ``os.environ`` for
a setting.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODES = ("fast", "exact")
GB = 1000**3  # the unit of every *_gb setting: decimal, as GPU and RAM sizes are quoted
ENV_PREFIX = "GLM53_"
# Variables with the prefix that are not settings: the GPU kit's prep.sh exports GLM53_SITE (its wheel dir);
# GLM53_NATIVE_BUILD is where the native libraries are looked for first (glm53/native/libraries.py); the Nix serve
# wrappers look for the NVIDIA driver in GLM53_DRIVER_DIR first (nix/pkgs/host-driver.sh).
FOREIGN_ENV = frozenset({"GLM53_SITE", "GLM53_NATIVE_BUILD", "GLM53_DRIVER_DIR"})
# nix/ci/check.sh's variables had the prefix once; a shell that still exports one is told the new name.
RENAMED_ENV = {"GLM53_NIX_CHROOT": "NIXCI_CHROOT", "GLM53_DEBIAN_MIRROR": "NIXCI_DEBIAN_MIRROR"}


class ConfigError(ValueError):
    """A setting has a value that is not accepted; the message names the variable or flag and the value."""


@dataclass(frozen=True)
class Parser:
    """Turns the text of an environment variable or flag into a value, or says what is accepted."""

    accepted: str  # shown in errors and in the README table
    parse: Callable[[str], Any]


def _number(kind: type, lo: float | None = None, hi: float | None = None, unit: str = "") -> Parser:
    noun = "an integer" if kind is int else "a number"
    if lo is not None and hi is not None:
        accepted = f"{noun} in {lo}..{hi}{unit}"
    elif lo is not None:
        accepted = f"{noun} >= {lo}{unit}"
    else:
        accepted = noun + unit

    def parse(text: str) -> Any:
        value = kind(text.strip())  # ValueError on junk, reported with `accepted`
        if kind is float and not math.isfinite(value):
            raise ValueError(text)
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise ValueError(text)
        return value

    return Parser(accepted, parse)


def _multiple_of(base: Parser, step: int) -> Parser:
    def parse(text: str) -> int:
        value = base.parse(text)
        if value % step:
            raise ValueError(text)
        return value

    return Parser(f"{base.accepted}, a multiple of {step}", parse)


def _optional(base: Parser, none_means: str) -> Parser:
    """Empty text means None; the README shows what None means."""
    return Parser(f"{base.accepted}, or empty ({none_means})", lambda t: None if not t.strip() else base.parse(t))


def _choice(*options: str) -> Parser:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in options:
            raise ValueError(text)
        return value

    return Parser("one of " + ", ".join(options), parse)


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(text)


BOOL = Parser("1/0, true/false, yes/no, on/off", _parse_bool)
AUTO_BOOL = Parser("auto, or 1/0, true/false, yes/no, on/off",
                   lambda t: "auto" if t.strip().lower() == "auto" else _parse_bool(t))


def _parse_nonempty(text: str) -> str:
    if not text.strip():
        raise ValueError(text)
    return text.strip()


NAME = Parser("non-empty text", _parse_nonempty)
PATH = Parser("a path", lambda t: Path(_parse_nonempty(t)).expanduser())
HOST = Parser("an IP address or host name", _parse_nonempty)


def _parse_store_url(text: str) -> str | None:
    value = text.strip()
    if value and not re.fullmatch(r"(redis|rediss|unix)://\S+", value):
        raise ValueError(text)
    return value or None


STORE_URL = Parser("a redis://, rediss:// or unix:// URL of a Redis or Valkey server, or empty (this process's memory)", _parse_store_url)


def _parse_cpus(text: str) -> str | tuple[int, ...]:
    """``auto`` or a Linux CPU list such as ``2-11,14``."""
    value = text.strip().lower()
    if value == "auto":
        return "auto"
    cpus: list[int] = []
    for part in value.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if not m:
            raise ValueError(text)
        first, last = int(m.group(1)), int(m.group(2) or m.group(1))
        if last < first:
            raise ValueError(text)
        cpus.extend(range(first, last + 1))
    if len(set(cpus)) != len(cpus):
        raise ValueError(text)
    return tuple(cpus)


def _parse_api_key(text: str) -> str | None:
    """Empty means no key. Otherwise what an ``Authorization: Bearer`` header carries intact: a space, a control
    character or a non-ASCII letter would be cut, folded or re-encoded on the way, and no client could match."""
    if text == "":
        return None
    if not all("!" <= c <= "~" for c in text):
        raise ValueError("not printable ASCII")
    return text


API_KEY = Parser("printable ASCII without spaces, or empty (no key)", _parse_api_key)


CPUS = Parser("auto, or a CPU list such as 2-11,14", _parse_cpus)


def _parse_expert_count(text: str) -> str | int:
    """``auto``, a count of experts, or a percentage of all routed experts such as ``11%``."""
    value = text.strip().lower()
    if value == "auto":
        return "auto"
    m = re.fullmatch(r"(\d+(?:\.\d+)?)%", value)
    if m:
        if float(m.group(1)) > 100:
            raise ValueError(text)
        return f"{m.group(1)}%"
    if not value.isdigit():
        raise ValueError(text)
    return int(value)


EXPERT_COUNT = Parser("auto, a number of experts, or a percentage of all routed experts such as 11%", _parse_expert_count)


def setting(
    parser: Parser,
    default: Any,
    meaning: str,
    *,
    flags: Sequence[str] = (),
    env: bool = True,
    secret: bool = False,
    show_default: str | None = None,
) -> Any:
    """Declare one setting. ``default`` is a value, or a ``{mode: value}`` dict when modes differ."""
    return field(
        metadata={
            "parser": parser,
            "default": default,
            "meaning": meaning,
            "flags": tuple(flags),
            "env": env,
            "secret": secret,
            "show_default": show_default,
        }
    )


def _default_root() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "glm53"


@dataclass(frozen=True)
class Settings:
    # --- what to run
    mode: str = setting(_choice(*MODES), "fast", "fast: adds the CPU tier for cold decode misses; exact: output bit-identical to stock exllamav3")
    engine: str = setting(
        _choice("auto", "exl3", "tiny"),
        "auto",
        "exl3: the model on a CUDA GPU; tiny: a small CPU demo model (gibberish, no files); auto: exl3 when a CUDA GPU and a model are present, else tiny",
    )
    root: Path = setting(PATH, None, "directory for the project's state: the downloaded model, caches, learned routing profiles", show_default="$XDG_DATA_HOME/glm53")
    model_dir: Path = setting(PATH, None, "the EXL3 checkpoint to serve", flags=("-m",), show_default="$GLM53_ROOT/models/GLM-5.3-Flash-exl3")
    model_repo: str = setting(NAME, "turboderp/GLM-5.3-Flash-exl3", "model hub repository to download the checkpoint from")
    model_revision: str = setting(NAME, "332ab457b709b7ba30dd9a448be5de03b80a7ac9", "pinned revision of that repository (branch 3.05bpw)")
    model_download: bool = setting(BOOL, False, "download the checkpoint into the model directory when it has no config.json (125 GB)")
    # --- serving
    host: str = setting(HOST, "127.0.0.1", "address to listen on (use 0.0.0.0 to serve other machines)")
    port: int = setting(_number(int, 1, 65535), 30000, "TCP port to listen on")
    served_name: str = setting(NAME, "glm-5.3-flash", "model id reported by /v1/models and accepted in requests")
    api_key: str | None = setting(API_KEY, None, "when set, every endpoint but /health requires `Authorization: Bearer <key>`", secret=True, show_default="unset (no key)")
    max_queue: int = setting(_number(int, 0, 100000), 256, "requests that may wait for a batch slot; beyond that, 429 with Retry-After")
    max_request_mb: float = setting(_number(float, 0.01, 1024, " MB"), 16.0, "largest request body accepted (413 beyond)")
    sse_keepalive_s: float = setting(_number(float, 0.1, 300, " s"), 5.0, "idle time after which a stream gets an SSE comment (keeps proxies and clients from timing out)")
    shutdown_grace_s: float = setting(_number(float, 0, 3600, " s"), 30.0, "on SIGTERM, how long in-flight requests may run to completion while new ones get 503; the rest are then cancelled")
    responses_store: int = setting(_number(int, 0, 100000), 256, "responses /v1/responses keeps in memory for previous_response_id (least recently used dropped first; 0: none)")
    responses_store_url: str | None = setting(STORE_URL, None, "a Redis or Valkey server that holds the stored responses instead, shared by every replica behind a router "
                                              "(each kept 30 days); a replica then continues any previous_response_id", secret=True, show_default="unset (in memory)")
    log_prompts: bool = setting(BOOL, False, "put prompt and completion text in the per-request access-log line (off: counts and timings only)")
    # --- engine
    cache_size: int = setting(_multiple_of(_number(int, 256, 16 * 1048576), 256), 131072, "KV cache size in tokens: the context one sequence may use, shared by all", flags=("-cs",))
    max_batch_size: int = setting(_number(int, 1, 256), 8, "jobs generated concurrently (continuous batching)")
    chunk_size: int = setting(_number(int, 16, 1048576), 8192, "prefill chunk in tokens", flags=("-chunk_size",))
    prefill_last_page_split: bool = setting(BOOL, {"fast": False, "exact": True}, "prefill a prompt's last page in a forward of its own, as stock exllamav3 does for recurrent models, "
                                            "to checkpoint the recurrent state there; off: one forward per chunk (offloaded, each forward streams "
                                            "every expert that is not in VRAM once)")
    recurrent_cache_gb: float = setting(_number(float, 0, None, " GB"), 4.0, "host RAM for recurrent-state checkpoints (least recently used dropped first), "
                                        "which let an agent's next turn prefill only its new tokens")
    prompt_end_checkpoints: bool = setting(BOOL, {"fast": True, "exact": False}, "with the one-pass prefill, have the recurrent layers checkpoint each prompt at its last page boundary "
                                           "inside the forward (off: a next turn prefills from the last checkpoint of a chunk or an answer); "
                                           "off in exact mode, as the split scan is not stock's arithmetic")
    ambs: int = setting(_number(int, 1, 256), 4, "streams decoded together in one batched step (recurrent-state slots)", flags=("-ambs",))
    vram_limit_gb: float | None = setting(_optional(_number(float, 1, None, " GB"), "the whole GPU"), None, "use at most this much VRAM (emulates a smaller card on a larger one)", show_default="unset (whole GPU)")
    triton_pin: Path | None = setting(_optional(PATH, "autotune"), None, "pin file of Triton autotune choices for the KDA kernels (autotuned picks change rounding), installed before the model loads", show_default="unset (autotune)")
    # --- offload: GPU expert cache and prefill staging
    ec_reserve_gb: float = setting(_number(float, 0, None, " GB"), {"fast": 1.5, "exact": 1.0}, "VRAM left free after the expert cache takes the rest")
    ec_cache_experts: Any = setting(EXPERT_COUNT, "auto", "most routed experts the VRAM cache holds; auto: as many as fit in the VRAM budget")
    ec_elastic_gb: float = setting(_number(float, 0, None, " GB"), 10.0, "expert-cache VRAM lent to activations and staging during a long prefill")
    ec_stage_gb: float = setting(_number(float, 0, None, " GB"), 2.6, "size of each of the two prefill staging buffers")
    ec_decay: float | None = setting(_optional(_number(float, 0.5, 1.0), "the policy's default"), None,
                                     "the expert cache's slow (popularity) score decay per decode step", show_default="unset (0.995)")
    ec_hysteresis: float | None = setting(_optional(_number(float, 1.0, 100.0), "the policy's default"), None,
                                          "how many times the weakest VRAM resident's score a missed expert must score to take its "
                                          "slot", show_default="unset (1.25)")
    ec_recency_weight: float | None = setting(_optional(_number(float, 0, 1e6), "the policy's default"), None,
                                              "weight of the expert cache's fast (recency) score per unit of measured reuse lift; 0: "
                                              "popularity alone (the policy before 2026-12-02)", show_default="unset (200)")
    ec_warm_horizon: float | None = setting(_optional(_number(float, 1, 1e6, " steps"), "the policy's default"), None,
                                            "the expert cache's warm start counts the routing profile as at most this many decode steps "
                                            "of picks (1e6: no cap, the 1 / (1 - decay) steps of the profile's steady state)", show_default="unset (200)")
    prefetch: bool = setting(BOOL, False, "exact mode's single-stream decode steps: after each MoE layer, predict the next layer's picks (its router on "
                             "this layer's input) and copy the predicted experts that are not in VRAM into a pool of VRAM slots while the next layer's "
                             "attention runs; bit-identical output. Refused beside the CPU tier, whose split would count a prefetched expert "
                             "as a miss (in fast mode it needs GLM53_CT_ENABLE=0)")
    prefetch_slots: int = setting(_number(int, 1, 16), 2, "VRAM slots of the prefetch pool (taken from the expert cache's), the most experts copied ahead per layer")
    prefetch_extra: int = setting(_number(int, 0, 56), 0, "experts predicted per token beyond the router's top-k (candidates when the top-k are resident)")
    prefetch_min_score: float | None = setting(_optional(_number(float, -10, 10), "every prediction"), None,
                                               "with GLM53_PREFETCH, copy only predicted experts whose score (the router's sigmoid "
                                               "plus its correction bias, on the previous layer's input) is at least this",
                                               show_default="unset (every prediction)")
    prefetch_window_budget: bool = setting(BOOL, False, "with GLM53_PREFETCH, copy no more experts ahead of a layer than the link carries "
                                           "in that layer's measured idle window (at least one); off: up to GLM53_PREFETCH_SLOTS")
    prefetch_min_precision: float | None = setting(_optional(_number(float, 0.0, 1.0), "no gate"), None,
                                                   "with GLM53_PREFETCH, a layer whose last copies were used at less than this share "
                                                   "stops prefetching for a while, then tries again",
                                                   show_default="unset (no gate)")
    prefetch_lead: bool = setting(BOOL, False, "with GLM53_PREFETCH, also copy the first MoE layer's likely picks (the previous step's picks of that layer) "
                                  "when a decode step starts, while the embedding, the dense layers and that layer's attention leave the link idle")
    host_ram_gb: float | None = setting(_optional(_number(float, 0.001, None, " GB"), "what the host has less the process's needs"), None,
                                        "host RAM for the routed experts; below what they take, a RAM tier of this size caches them over "
                                        "the checkpoint's files, read from disk with O_DIRECT on a miss (unset: MemAvailable, or the "
                                        "cgroup's room, less the process's needs; with enough RAM every expert is held as before)",
                                        show_default="unset (MemAvailable less the process's needs)")
    disk_threads: int = setting(_number(int, 1, 256), 8, "the RAM tier's disk reader threads: preads in flight on the checkpoint's files")
    disk_piece_kb: int = setting(_multiple_of(_number(int, 4, 65536, " KiB"), 4), 1024,
                                 "the RAM tier's disk reads are cut into pieces of this size, each read by any of the reader's "
                                 "threads, so that one expert's read has several preads in flight")
    ram_tier_decay: float | None = setting(_optional(_number(float, 0.5, 1.0), "the policy's default"), None,
                                           "the RAM tier's slow (popularity) score decay per decode step", show_default="unset (0.999)")
    ram_tier_hysteresis: float | None = setting(_optional(_number(float, 1.0, 100.0), "the policy's default"), None,
                                                "how many times the weakest RAM-tier resident's score an expert that missed the tier "
                                                "must score to take its slot", show_default="unset (1.25)")
    ram_tier_recency_weight: float | None = setting(_optional(_number(float, 0, 1e6), "the policy's default"), None,
                                                    "weight of the RAM tier's fast (recency) score per unit of the reuse lift it measures "
                                                    "on its own misses; 0: popularity alone", show_default="unset (800)")
    ram_tier_vram_score: float | None = setting(_optional(_number(float, 0.0, 1.0), "the policy's default"), None,
                                                "the VRAM cache's residents' starting scores in the RAM tier's policy, as a share of "
                                                "their warm ones (1: an expert the VRAM cache evicts keeps its popularity; 0: it "
                                                "earns a RAM slot from scratch)", show_default="unset (1)")
    ram_tier_read_ahead: int = setting(_number(int, 0, 64), 0,
                                       "with a RAM tier, in one-stream decode: how many of the next MoE layer's likeliest experts (its "
                                       "router on this layer's input) that neither VRAM nor RAM holds are read from disk while this "
                                       "layer computes, in blocks of their own out of the RAM budget; 0: none (reads start at each "
                                       "layer's routing)")
    ram_tier_exclusive: bool | None = setting(_optional(BOOL, "the policy's default"), None,
                                              "the RAM tier gives up first the slot of an expert the VRAM cache has held for its last "
                                              "32 decode steps, so its slots hold what VRAM lacks; 0: its slots may duplicate VRAM's",
                                              show_default="unset (1)")
    ram_tier_write_back: bool = setting(BOOL, False,
                                        "with a RAM tier, in decode: an expert the VRAM cache evicts that no RAM slot holds is copied "
                                        "from its VRAM slot into one when the RAM tier's policy takes it (the cache's step predicted "
                                        "on the host by its own definition), instead of being read from disk when next missed; the "
                                        "tier then gives up at once the slot of an expert VRAM holds; off until measured on the GPU")
    # --- offload: CPU tier (fast mode)
    ct_cpus: Any = setting(CPUS, "auto", "CPUs of the CPU tier; auto: one per physical core, leaving cores for the GPU-feeding thread")
    ct_threads: int = setting(_number(int, 0, 4096), 0, "CPU-tier threads; 0: one per CPU of GLM53_CT_CPUS")
    ct_enable: Any = setting(AUTO_BOOL, "auto", "fast mode: compute the coldest decode misses on the CPU tier; auto: on when the costs measured at start give it a share of the misses (one log line says why not, otherwise), a job late for GLM53_CT_DEADLINE_MS is computed on the GPU instead")
    ct_codebook: str = setting(_choice("int16", "fma", "fp16"), "int16", "CPU-tier arithmetic: int16, fma's weights against each projection's input rounded to 16 bits per 128 values, summed "
                            "exactly in integers; fma, exllamav3's GPU codebook before its fp16 rounding, against fp32 inputs; fp16, the GPU's "
                            "fp16 weights bit for bit")
    ct_deadline_ms: float = setting(_number(float, 0.1, 10000, " ms"), 2.0, "the longest the GPU waits, once its own part of a layer is done, for a CPU-tier job before taking it back and computing its experts itself (counted in /stats); a job waits less: its experts' link time, at least 0.3 ms")
    ct_b: float | None = setting(_optional(_number(float, 0.0001, None, " ms"), "measured at start"), None, "CPU-tier cost per expert in ms; overrides the value measured at start", show_default="unset (measured)")
    # --- measurement
    link_emulate_gbs: float | None = setting(_optional(_number(float, 0.1, None, " GB/s"), "the full link"), None,
                                             "measurements only: emulate a slower host link of this rate in band: each host-to-GPU "
                                             "transfer is followed on its own stream by the GPU-side delay the slower link would add "
                                             "(at most the rate measured at start)", show_default="unset (the full link)")

    sources: Mapping[str, str] = field(default_factory=dict, compare=False)  # setting name -> default|env|flag

    def public(self) -> dict[str, Any]:
        """Effective settings for /server_info and `glm53 info`: secrets redacted, paths as text."""
        out: dict[str, Any] = {}
        for f in setting_fields():
            value = getattr(self, f.name)
            if f.metadata["secret"]:
                value = "<redacted>" if value else None
            elif isinstance(value, Path):
                value = str(value)
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out


def given(settings: Settings, **fields: str) -> dict[str, Any]:
    """``{field: settings.<setting>}`` for each ``field=setting`` whose setting is set (not None): what an optional
    setting overrides of a policy's defaults (``cache.Policy.from_settings``, ``ram_tier.TierPolicy.from_settings``)."""
    return {name: getattr(settings, key) for name, key in fields.items() if getattr(settings, key) is not None}


def setting_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(Settings) if "parser" in f.metadata]


def env_var(name: str) -> str:
    return ENV_PREFIX + name.upper()


def flag_names(f: dataclasses.Field) -> list[str]:
    return list(f.metadata["flags"]) + ["--" + f.name.replace("_", "-")]


def mode_default(f: dataclasses.Field, mode: str) -> Any:
    default = f.metadata["default"]
    return default[mode] if isinstance(default, dict) else default


def default_of(name: str, mode: str = "exact") -> Any:
    """The default of setting ``name`` in ``mode``: for code that also runs without settings (a bench, a test)."""
    (f,) = [f for f in setting_fields() if f.name == name]
    return mode_default(f, mode)


def _argument_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for f in setting_fields():
        if f.metadata["secret"]:
            continue  # secrets only from the environment: command lines are visible to every user
        # argparse %-formats help texts (for %(default)s); a meaning is plain text, so its "%" is escaped
        ap.add_argument(*flag_names(f), dest=f.name, default=None, metavar="VALUE", help=f.metadata["meaning"].replace("%", "%%"))
    return ap


def add_setting_flags(ap: argparse.ArgumentParser) -> None:
    """Put every setting's flags on a subcommand's parser (values stay text; ``load`` parses them)."""
    for action in _argument_parser()._actions:
        ap._add_action(action)


def load(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """Build the effective settings from flags (``argv``, without the program name) and the environment.

    :raise ConfigError: for an unknown ``GLM53_*`` variable, an unknown flag or a value that is not accepted.
    """
    environ = os.environ if environ is None else environ
    flags = _parse_flags(argv or [])
    unknown = sorted(k for k in environ if k.startswith(ENV_PREFIX) and k not in FOREIGN_ENV and k not in _ENV_NAMES)
    if unknown and unknown[0] in RENAMED_ENV:
        raise ConfigError(f"{unknown[0]} is not a glm53 setting: nix/ci/check.sh reads it as {RENAMED_ENV[unknown[0]]} now")
    if unknown:
        raise ConfigError(f"{unknown[0]} is not a glm53 setting; known variables: {', '.join(sorted(_ENV_NAMES))}")
    by_name = {f.name: f for f in setting_fields()}
    mode = _resolve(by_name["mode"], flags, environ, "fast")[0]
    values: dict[str, Any] = {"mode": mode}
    sources: dict[str, str] = {}
    for f in setting_fields():
        values[f.name], sources[f.name] = _resolve(f, flags, environ, mode)
    if values["root"] is None:
        values["root"] = _default_root()
    if values["model_dir"] is None:
        values["model_dir"] = values["root"] / "models" / "GLM-5.3-Flash-exl3"
    _refuse_impossible(values)
    return Settings(**values, sources=sources)


def _refuse_impossible(values: Mapping[str, Any]) -> None:
    """:raise ConfigError: settings that cannot all hold, named with what to change. Prefetch and the CPU tier
    exclude each other (the tier's split would count a prefetched expert as a miss), so prefetch is refused wherever
    the tier may run: decided here, the offload's start sizes the cache knowing whether the pool's slots are used."""
    if values["prefetch"] and values["mode"] == "fast" and values["ct_enable"] is not False:
        raise ConfigError(f"GLM53_PREFETCH=1 cannot run beside the CPU tier (GLM53_MODE=fast, GLM53_CT_ENABLE="
                          f"{_text(values['ct_enable'])}): set GLM53_MODE=exact or GLM53_CT_ENABLE=0, or leave prefetch off")
    if values["prefetch_lead"] and not values["prefetch"]:
        raise ConfigError("GLM53_PREFETCH_LEAD=1 is prefetch's lead: it needs GLM53_PREFETCH=1")


def _parse_flags(argv: Sequence[str]) -> dict[str, str]:
    ns, rest = _argument_parser().parse_known_args(list(argv))
    if rest:
        raise ConfigError(f"unknown argument {rest[0]!r}; see `glm53 serve --help`")
    return {k: v for k, v in vars(ns).items() if v is not None}


def _resolve(f: dataclasses.Field, flags: Mapping[str, str], environ: Mapping[str, str], mode: str) -> tuple[Any, str]:
    parser: Parser = f.metadata["parser"]
    if f.name in flags:
        origin, text, source = "/".join(flag_names(f)), flags[f.name], "flag"
    elif f.metadata["env"] and env_var(f.name) in environ:
        origin, text, source = env_var(f.name), environ[env_var(f.name)], "env"
    else:
        return mode_default(f, mode), "default"
    try:
        return parser.parse(text), source
    except (ValueError, TypeError):
        shown = "<redacted>" if f.metadata["secret"] else repr(text)
        raise ConfigError(f"{origin}={shown} is not accepted: expected {parser.accepted}") from None


_ENV_NAMES = frozenset(env_var(f.name) for f in setting_fields() if f.metadata["env"])


def markdown_table() -> str:
    """The README's configuration table, generated from the definitions above."""
    rows = ["| variable | flags | accepted | default (fast / exact) | meaning |", "|---|---|---|---|---|"]
    for f in setting_fields():
        flags = "" if f.metadata["secret"] else ", ".join(f"`{x}`" for x in flag_names(f))
        rows.append(
            f"| `{env_var(f.name)}` | {flags} | {f.metadata['parser'].accepted} | {_shown_default(f)} | {f.metadata['meaning']} |"
        )
    return "\n".join(rows) + "\n"


def _shown_default(f: dataclasses.Field) -> str:
    if f.metadata["show_default"]:
        return f.metadata["show_default"]
    default = f.metadata["default"]
    if isinstance(default, dict):
        return " / ".join(f"`{_text(default[m])}`" for m in MODES)
    return f"`{_text(default)}`"


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


README_BEGIN = "<!-- config-table: generated by `make readme` from glm53/config.py -->"
README_END = "<!-- end config-table -->"


def readme_with_table(readme: str) -> str:
    """``readme`` with the text between the config-table markers replaced by the current table."""
    head, sep, rest = readme.partition(README_BEGIN)
    _, sep2, tail = rest.partition(README_END)
    if not sep or not sep2:
        raise ValueError("README.md lacks the config-table markers")
    return f"{head}{README_BEGIN}\n{markdown_table()}{README_END}{tail}"
