import pytest

from hybridmem.config import Config
from hybridmem.graph.units import fmt_bytes, parse_bytes


@pytest.mark.parametrize("value,expected", [
    (1024, 1024), ("512MiB", 512 * 2**20), ("8GB", 8 * 10**9), ("8GiB", 8 * 2**30), ("1.5e3", 1500),
    ("2 kib", 2048), ("100", 100), (2.0, 2),
])
def test_parse_bytes(value, expected):
    assert parse_bytes(value) == expected


@pytest.mark.parametrize("value", ["-1GiB", -5, "lots", "8 parsecs", None, True, float("nan"), [1]])
def test_parse_bytes_rejects_with_accepted_forms(value):
    with pytest.raises(ValueError, match="expected an int of bytes.*512MiB"):
        parse_bytes(value)


def test_percentages_need_a_reference():
    assert parse_bytes("60%", total=1000) == 600
    with pytest.raises(ValueError, match="percentage needs a reference"):
        parse_bytes("60%")


def test_fmt_bytes():
    assert fmt_bytes(512) == "512 B" and fmt_bytes(3 * 2**30) == "3.00 GiB"


def test_precedence_kwargs_env_yaml(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("budget: 1GiB\npolicies: [swap]\nverbose: true\nplugins: {swap: {pool: 4}}\n")
    c = Config.resolve(config=y, env={})
    assert c.budget == 2**30 and c.policies == ("swap",) and c.verbose and c.extra == {"swap": {"pool": 4}}
    c = Config.resolve(env={"HYBRIDMEM_CONFIG": str(y), "HYBRIDMEM_BUDGET": "2GiB"})
    assert c.budget == 2 * 2**30 and c.policies == ("swap",)
    c = Config.resolve(env={"HYBRIDMEM_BUDGET": "2GiB", "HYBRIDMEM_POLICIES": "recompute, compress"}, budget="3GiB")
    assert c.budget == 3 * 2**30 and c.policies == ("recompute", "compress")
    assert Config.resolve(env={}, budget="60%").budget == "60%"
    assert Config.resolve(env={}).budget is None


def test_bad_config_values(tmp_path):
    with pytest.raises(ValueError, match="unknown setting.*'colour'.*accepted"):
        Config.resolve(env={}, colour="red")
    with pytest.raises(ValueError, match="invalid budget"):
        Config.resolve(env={"HYBRIDMEM_BUDGET": "eight gigs"})
    y = tmp_path / "c.yaml"
    y.write_text("- just\n- a list\n")
    with pytest.raises(ValueError, match="expected a mapping"):
        Config.resolve(config=y, env={})
    y.write_text("budget: [unclosed\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        Config.resolve(config=y, env={})


def test_mapping_config_takes_plugins_like_yaml() -> None:
    cfg = Config.resolve({"budget": "1GiB", "plugins": {"compress": {"lossy": ["bf16"]}}}, env={})
    assert cfg.extra == {"compress": {"lossy": ["bf16"]}}
    with pytest.raises(ValueError, match="both 'plugins' and 'extra'"):
        Config.resolve({"plugins": {}, "extra": {}}, env={})


# ---- budgets and options: validated where they are read, naming the source and the accepted values ----
@pytest.mark.parametrize("bad", [0, "0", "0GiB", 3.5, "3.5", 1e9, "1e400", "0%", "150%", -1])
def test_budget_must_be_a_positive_whole_number_of_bytes(bad: object) -> None:
    with pytest.raises(ValueError, match="budget.*positive int of bytes.*512MiB"):
        Config.resolve(env={}, budget=bad)


@pytest.mark.parametrize("bad", ["0", "0GiB", "3.5", "1e400", "0%", "150%", "-1"])
def test_budget_from_the_environment_names_the_variable(bad: str) -> None:
    with pytest.raises(ValueError, match=f"HYBRIDMEM_BUDGET={bad!r}.*positive int of bytes"):
        Config.resolve(env={"HYBRIDMEM_BUDGET": bad})


def test_budget_beyond_the_hosts_memory_is_refused() -> None:
    import hybridmem

    with pytest.raises(ValueError, match=r"budget.*more than the host's memory \(.*GiB, .* bytes\)"):
        hybridmem.enable(budget="1e99GiB", device="cpu")
    assert not hybridmem.enabled()


def test_verbose_accepts_booleans_only(tmp_path) -> None:
    assert Config.resolve(env={"HYBRIDMEM_VERBOSE": "yes"}).verbose is True
    assert Config.resolve(env={"HYBRIDMEM_VERBOSE": "0"}).verbose is False
    y = tmp_path / "c.yaml"
    y.write_text("verbose: maybe\n")
    with pytest.raises(ValueError, match=r"c.yaml.*verbose.*'maybe'.*true, false"):
        Config.resolve(config=y, env={})
    with pytest.raises(ValueError, match=r"HYBRIDMEM_VERBOSE.*'maybe'.*1, 0"):
        Config.resolve(env={"HYBRIDMEM_VERBOSE": "maybe"})


def test_unknown_policy_option_names_the_policy_the_source_and_the_accepted_ones(tmp_path) -> None:
    import hybridmem

    y = tmp_path / "c.yaml"
    y.write_text("budget: 1GiB\nplugins: {swap: {teleport: 3}}\n")
    with pytest.raises(ValueError, match=r"c.yaml: 'plugins': policy 'swap': unknown option\(s\) \['teleport'\]; "
                                         r"accepted: .*max_cached_bytes"):
        hybridmem.enable(config=y, device="cpu")
    with pytest.raises(ValueError, match=r"config: 'plugins': recompute takes no options"):
        hybridmem.enable(config={"budget": "1GiB", "plugins": {"recompute": {"fast": True}}}, device="cpu")
    with pytest.raises(ValueError, match=r"config: 'plugins': unknown key 'swapp'; accepted: the policies"):
        hybridmem.enable(config={"budget": "1GiB", "plugins": {"swapp": {}}}, device="cpu")
    assert not hybridmem.enabled()


def test_bad_config_through_the_environment_is_one_line_and_status_2(tmp_path) -> None:
    import os
    import subprocess
    import sys

    y = tmp_path / "c.yaml"
    y.write_text("budget: 1GiB\nplugins: {swap: {teleport: 3}}\n")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("HYBRIDMEM_")}, "HYBRIDMEM_CONFIG": str(y)}
    res = subprocess.run([sys.executable, "-c", "import torch; print('trained')"], capture_output=True,
                         text=True, timeout=120, env=env)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr
    assert "unknown option(s) ['teleport']" in res.stderr and "c.yaml" in res.stderr


@pytest.mark.parametrize("var,value,kwargs,match", [
    ("HYBRIDMEM_DEVICE", "tpu", {}, r"HYBRIDMEM_DEVICE='tpu': invalid device 'tpu': expected 'cpu', 'cuda'"),
    ("HYBRIDMEM_POLICIES", "swap,teleport", {"device": "cpu"},
     r"HYBRIDMEM_POLICIES='swap,teleport': unknown policy 'teleport'; known"),
    ("HYBRIDMEM_LOSSY", "zzz", {"device": "cpu", "policies": ("compress",)},
     r"HYBRIDMEM_LOSSY='zzz': unknown codec 'zzz'; known"),
])
def test_settings_checked_by_the_runtime_name_their_variable(monkeypatch, var, value, kwargs, match) -> None:
    import hybridmem

    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=match):
        hybridmem.enable(budget="1GiB", **kwargs)
    assert not hybridmem.enabled()
