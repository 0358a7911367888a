import re
import subprocess
from pathlib import Path

import pytest

from glm53 import config

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"


def load(argv=(), **env):
    return config.load(list(argv), env)


def test_mode_defaults():
    assert load().ec_reserve_gb == 1.5 and load().prefill_last_page_split is False
    exact = load(GLM53_MODE="exact")
    assert exact.ec_reserve_gb == 1.0 and exact.prefill_last_page_split is True


def test_precedence_mode_defaults_then_env_then_flags_last_flag_wins():
    s = load(["--mode", "exact", "--port", "1000", "--port", "2000"], GLM53_PORT="3000", GLM53_EC_RESERVE_GB="2")
    assert s.mode == "exact" and s.port == 2000 and s.ec_reserve_gb == 2.0
    assert s.sources["port"] == "flag" and s.sources["ec_reserve_gb"] == "env" and s.sources["chunk_size"] == "default"
    # the flag's mode picks the defaults even when the environment says otherwise
    assert load(["--mode", "exact"], GLM53_MODE="fast").ec_reserve_gb == 1.0


def test_short_flags_of_the_original():
    s = load(["-m", "/models/x", "-cs", "65536", "-chunk_size", "4096", "-ambs", "2"])
    assert s.model_dir == Path("/models/x") and s.cache_size == 65536 and s.chunk_size == 4096 and s.ambs == 2


def test_model_dir_defaults_under_root():
    assert load(GLM53_ROOT="/srv/glm").model_dir == Path("/srv/glm/models/GLM-5.3-Flash-exl3")


@pytest.mark.parametrize(
    "argv,env,fragment",
    [
        ([], {"GLM53_PORT": "http"}, "GLM53_PORT='http' is not accepted: expected an integer in 1..65535"),
        (["--port", "0"], {}, "--port='0' is not accepted"),
        ([], {"GLM53_MODE": "turbo"}, "expected one of fast, exact"),
        ([], {"GLM53_EC_RESERVE_GB": "-1"}, "expected a number >= 0 GB"),
        ([], {"GLM53_EC_RESERVE_GB": "inf"}, "GLM53_EC_RESERVE_GB='inf'"),
        (["-cs", "1000"], {}, "a multiple of 256"),
        ([], {"GLM53_CT_CPUS": "3-1"}, "auto, or a CPU list"),
        ([], {"GLM53_MODEL_DOWNLOAD": "maybe"}, "1/0, true/false"),
        ([], {"GLM53_MODEL_DIRR": "/x"}, "GLM53_MODEL_DIRR is not a glm53 setting"),
        (["--nope"], {}, "unknown argument '--nope'"),
    ],
)
def test_bad_values_name_the_variable_the_value_and_what_is_accepted(argv, env, fragment):
    with pytest.raises(config.ConfigError) as exc:
        config.load(argv, env)
    assert fragment in str(exc.value)


@pytest.mark.parametrize("argv, refused", [
    (["--prefetch", "1"], "GLM53_CT_ENABLE=auto"),  # fast mode's default: the tier may run
    (["--prefetch", "1", "--ct-enable", "1"], "GLM53_CT_ENABLE=1"),
    (["--prefetch-lead", "1", "--mode", "exact"], "GLM53_PREFETCH_LEAD=1 is prefetch's lead"),
    (["--prefetch", "1", "--mode", "exact"], None),
    (["--prefetch", "1", "--ct-enable", "0"], None),  # fast mode without its tier
    (["--prefetch", "1", "--prefetch-lead", "1", "--mode", "exact"], None),
])
def test_prefetch_is_refused_wherever_the_cpu_tier_may_run_and_its_lead_without_it(argv, refused):
    if refused is None:
        assert config.load(argv, {}).prefetch
        return
    with pytest.raises(config.ConfigError, match="GLM53_") as exc:
        config.load(argv, {})
    assert refused in str(exc.value)


def test_cpu_lists_and_optional_values():
    assert load(GLM53_CT_CPUS="2-4,7").ct_cpus == (2, 3, 4, 7)
    assert load(GLM53_CT_B="").ct_b is None and load(GLM53_CT_B="0.1").ct_b == 0.1


@pytest.mark.parametrize("unsendable", ["sk-secret with a space", "sk-secret\n", "sk-secrét", " "])
def test_secrets_are_redacted_and_never_flags(unsendable):
    s = load(GLM53_API_KEY="sk-secret")
    assert s.api_key == "sk-secret" and s.public()["api_key"] == "<redacted>"
    assert load(GLM53_API_KEY="").api_key is None
    with pytest.raises(config.ConfigError):
        load(["--api-key", "x"])
    # a key no client could send (it would not survive an Authorization header) is refused without being shown
    with pytest.raises(config.ConfigError) as exc:
        load(GLM53_API_KEY=unsendable)
    message = str(exc.value)
    assert message.startswith("GLM53_API_KEY=<redacted> is not accepted: expected printable ASCII without spaces")
    assert "secret" not in message


def test_the_gpu_kits_variable_is_not_refused():
    assert load(GLM53_SITE="/tmp/site").port == 30000


def test_the_native_library_directory_is_not_refused():
    assert load(GLM53_NATIVE_BUILD="/opt/glm53-native").port == 30000


def test_readme_table_is_generated_from_the_definitions():
    text = README.read_text()
    assert config.readme_with_table(text) == text, "README config table is stale: run `make readme`"


def test_variables_the_projects_scripts_read_do_not_stop_the_server():
    """A variable a script of this project reads may be exported in the shell that then runs `glm53 serve`."""
    files = subprocess.run(["git", "ls-files", "*.sh", ".ci/run"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    assert "nix/ci/check.sh" in files
    read = {(f, name) for f in files for name in re.findall(r"\bGLM53_[A-Z0-9_]+", (REPO / f).read_text())}
    known = {config.env_var(f.name) for f in config.setting_fields()} | config.FOREIGN_ENV
    assert sorted((f, name) for f, name in read if name not in known) == []


@pytest.mark.parametrize("old,new", [("GLM53_NIX_CHROOT", "NIXCI_CHROOT"), ("GLM53_DEBIAN_MIRROR", "NIXCI_DEBIAN_MIRROR")])
def test_the_ci_variables_old_names_say_what_they_are_now(old, new):
    with pytest.raises(config.ConfigError) as exc:
        load(**{old: "/somewhere"})
    assert str(exc.value) == f"{old} is not a glm53 setting: nix/ci/check.sh reads it as {new} now"
