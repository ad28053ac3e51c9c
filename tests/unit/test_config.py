"""pipeline.config: defaults, shipped examples, unknown keys, bounds, --set overrides."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeline.config import Config, ConfigError, apply_override, load_config

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.toml"))


def _write(tmp_path: Path, text: str, name: str = "run.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_defaults_validate() -> None:
    cfg = load_config(None)
    assert cfg == Config()
    assert cfg.trainer.max_staleness == 1 and cfg.generation.num_generations == 8
    assert [r.fn for r in cfg.scoring.rewards] == ["workers.tasks.rewards:copy_reward"]


def test_examples_directory_ships_configs() -> None:
    assert EXAMPLES, "no examples/*.toml found"


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_shipped_example_parses(path: Path) -> None:
    cfg = load_config(path)
    assert isinstance(cfg, Config)


def test_copy_example_values_are_read_not_defaulted() -> None:
    cfg = load_config(Path(__file__).resolve().parents[2] / "examples" / "copy.toml")
    assert cfg.run.name == "copy"
    assert cfg.trainer.max_steps == 6000 and cfg.up.generators == 2
    assert [(r.fn, r.weight) for r in cfg.scoring.rewards] == [
        ("workers.tasks.rewards:copy_reward", 1.0), ("workers.tasks.rewards:exact_match", 0.0)]


# ---------------------------------------------------------------- errors name the key


@pytest.mark.parametrize(
    ("toml", "key"),
    [
        ("[trainer]\nlrr = 1e-4\n", "trainer.lrr"),
        ("[generation]\ntemprature = 0.7\n", "generation.temprature"),
        ("[trainerr]\nlr = 1e-4\n", "trainerr"),
        ("name = 'x'\n", "name"),
        ("[scoring]\nrewards = [{ fn = 'a.b:c', wieght = 1.0 }]\n", "scoring.rewards.0.wieght"),
    ],
)
def test_unknown_key_is_an_error_naming_the_dotted_key(tmp_path: Path, toml: str, key: str
                                                       ) -> None:
    p = _write(tmp_path, toml)
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    assert f"  {key}: unknown key" in str(ei.value)
    assert str(p) in str(ei.value)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("trainer.max_staleness=-1", "trainer.max_staleness"),
        ("generation.top_p=1.5", "generation.top_p"),
        ("generation.top_p=0", "generation.top_p"),
        ("generation.temperature=0", "generation.temperature"),
        ("generation.num_generations=1", "generation.num_generations"),
        ("trainer.epsilon=1.0", "trainer.epsilon"),
        ("trainer.loss_type=ppo", "trainer.loss_type"),
        ("run.name='a b'", "run.name"),
        ('run.name="a\\n"', "run.name"),
        ("bus.block_ms=5", "bus.block_ms"),
        ("trainer.lr=fast", "trainer.lr"),
    ],
)
def test_out_of_range_value_is_an_error_naming_the_key(override: str, key: str) -> None:
    with pytest.raises(ConfigError) as ei:
        load_config(None, [override])
    msg = str(ei.value)
    assert f"  {key}: " in msg
    assert "unknown key" not in msg
    assert "(defaults)" in msg


def test_in_range_boundary_values_are_accepted() -> None:
    cfg = load_config(None, ["trainer.max_staleness=0", "generation.top_p=1.0",
                             "generation.num_generations=2"])
    assert cfg.trainer.max_staleness == 0 and cfg.generation.top_p == 1.0


def test_cross_field_check_is_an_error() -> None:
    with pytest.raises(ConfigError, match="is_clip_min must be <= is_clip_max"):
        load_config(None, ["trainer.is_clip_min=4", "trainer.is_clip_max=3"])


# ---------------------------------------------------------------- --set overrides


def test_overrides_are_parsed_as_toml_values_and_applied(tmp_path: Path) -> None:
    p = _write(tmp_path, '[run]\nname = "file"\n[trainer]\nlr = 1e-4\nmax_steps = 10\n')
    cfg = load_config(p, [
        "trainer.lr=3e-4",          # float
        "trainer.max_steps = 7",    # int, spaces around '=' allowed
        "run.name=myrun",           # not TOML -> taken as a string
        "model.path=some/dir",      # string without quotes containing '/'
        "task.name='reverse'",      # quoted TOML string
        "up.scorers=3",             # nested: section absent from the file
        "up.plot=false",            # bool
        "trainer.adam_betas=[0.8, 0.95]",
    ])
    assert cfg.trainer.lr == pytest.approx(3e-4) and isinstance(cfg.trainer.lr, float)
    assert cfg.trainer.max_steps == 7
    assert cfg.run.name == "myrun"
    assert cfg.model.path == "some/dir"
    assert cfg.task.name == "reverse"
    assert cfg.up.scorers == 3 and cfg.up.plot is False
    assert cfg.trainer.adam_betas == (0.8, 0.95)


def test_later_override_wins() -> None:
    cfg = load_config(None, ["trainer.max_steps=5", "trainer.max_steps=9"])
    assert cfg.trainer.max_steps == 9


def test_override_creating_an_unknown_section_is_an_error_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"  nosuch: unknown key"):
        load_config(None, ["nosuch.key=1"])


@pytest.mark.parametrize("bad", ["no_equals", "=5", " = 5", ""])
def test_malformed_override_is_an_error(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"expected section\.key=value"):
        load_config(None, [bad])


def test_override_through_a_scalar_is_an_error(tmp_path: Path) -> None:
    p = _write(tmp_path, "[trainer]\nlr = 1e-4\n")
    with pytest.raises(ConfigError, match="'lr' is not a section"):
        load_config(p, ["trainer.lr.x=1"])


def test_apply_override_mutates_the_raw_dict_in_place() -> None:
    data: dict = {"trainer": {"lr": 1.0}}
    apply_override(data, "trainer.lr=2")
    apply_override(data, "a.b.c=x")
    assert data == {"trainer": {"lr": 2}, "a": {"b": {"c": "x"}}}


# ---------------------------------------------------------------- files


def test_missing_file_is_an_error_naming_the_path(tmp_path: Path) -> None:
    p = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=re.escape(f"config file not found: {p}")):
        load_config(p)


def test_invalid_toml_is_an_error_naming_the_path(tmp_path: Path) -> None:
    p = _write(tmp_path, "[trainer\nlr = \n")
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    assert str(ei.value).startswith(f"{p}: not valid TOML")


def test_config_path_that_is_a_directory_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path}: cannot read the config file")):
        load_config(tmp_path)


def test_config_file_that_is_not_utf8_is_an_error_naming_it(tmp_path: Path) -> None:
    p = tmp_path / "latin1.toml"
    p.write_bytes('[run]\nname = "caf\u00e9"\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match=re.escape(f"{p}: not UTF-8 text")):
        load_config(p)


# ---------------------------------------------------------------- derived values


def test_window_defaults_to_staleness_plus_one_times_groups_per_step() -> None:
    assert load_config(None).trainer.window == (1 + 1) * 8
    cfg = load_config(None, ["trainer.max_staleness=2", "trainer.groups_per_step=5"])
    assert cfg.trainer.window == 15


def test_admission_window_overrides_the_derived_window() -> None:
    cfg = load_config(None, ["trainer.max_staleness=2", "trainer.groups_per_step=5",
                             "trainer.admission_window=7"])
    assert cfg.trainer.window == 7


def test_redis_url_falls_back_to_the_embedded_socket_under_output_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["run.output_dir=out/r1"])
    sock = tmp_path.resolve() / "out" / "r1" / "redis" / "redis.sock"
    assert cfg.embedded_socket == sock
    assert cfg.redis_url == f"unix://{sock}"


def test_configured_redis_url_is_used_as_is() -> None:
    cfg = load_config(None, ["bus.redis_url='redis://h:6380/0'"])
    assert cfg.redis_url == "redis://h:6380/0"


def test_readme_configuration_table_is_current() -> None:
    """docs/configuration.md's table is `reference_rows()` verbatim: a new or
    re-documented key fails here until the table is regenerated."""
    from pathlib import Path

    from pipeline.config import reference_rows

    readme = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    start = readme.index("| key | default | meaning |")
    table = readme[start:readme.index("\n\n", start)].splitlines()[2:]
    assert table == reference_rows()


def test_vllm_engine_without_servers_fails_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"generation\.vllm\.urls"):
        load_config(None, ["generation.engine=vllm"])
    cfg = load_config(None, ["generation.engine=vllm", "generation.vllm.launch=1"])
    assert cfg.generation.vllm.launch == 1
    cfg = load_config(None, ["generation.engine=vllm",
                             "generation.vllm.urls=['http://127.0.0.1:8000']"])
    assert cfg.generation.vllm.urls == ["http://127.0.0.1:8000"]


def test_lora_section_and_its_keys_are_validated() -> None:
    assert load_config(None).model.lora is None
    cfg = load_config(None, ["model.lora.rank=4"])
    assert cfg.model.lora is not None and cfg.model.lora.rank == 4
    with pytest.raises(ConfigError, match=r"model\.lora\.rank"):
        load_config(None, ["model.lora.rank=0"])
    with pytest.raises(ConfigError, match=r"model\.lora\.ranks: unknown key"):
        load_config(None, ["model.lora.ranks=4"])


def test_every_example_config_loads() -> None:
    from pathlib import Path

    examples = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.toml"))
    assert len(examples) >= 4
    for path in examples:
        load_config(path)  # a key renamed or removed fails here, naming the key


# ---------------------------------------------------------------- finite floats, run names


def _float_keys() -> list[tuple[str, str]]:
    """Every float-typed key of Config (scalars, optionals, tuples; optional sections and
    the reward list included), with a TOML value that puts ``{x}`` into each float slot."""
    import types
    import typing

    from pydantic import BaseModel

    out: list[tuple[str, str]] = []

    def members(ann: object) -> list[object]:
        origin = typing.get_origin(ann)
        if origin in (typing.Union, types.UnionType):
            return [a for a in typing.get_args(ann) if a is not type(None)]
        return [ann]

    def walk(prefix: str, model: type[BaseModel]) -> None:
        for key, info in model.model_fields.items():
            for ann in members(info.annotation):
                origin, args = typing.get_origin(ann), typing.get_args(ann)
                if isinstance(ann, type) and issubclass(ann, BaseModel):
                    walk(f"{prefix}{key}.", ann)
                elif origin is list and isinstance(args[0], type) and issubclass(
                        args[0], BaseModel):
                    walk(f"{prefix}{key}[].", args[0])
                elif ann is float:
                    out.append((f"{prefix}{key}", "{x}"))
                elif origin is tuple and float in args:
                    out.append((f"{prefix}{key}", "[" + ", ".join("{x}" for _ in args) + "]"))

    walk("", Config)
    return out


FLOAT_KEYS = _float_keys()


def test_float_keys_are_found() -> None:
    keys = {k for k, _ in FLOAT_KEYS}
    assert {"trainer.lr", "scoring.reward_timeout_s", "trainer.adam_betas", "model.lora.alpha",
            "scoring.rewards[].weight", "eval.rewards[].weight", "eval.pass_threshold"} <= keys
    assert len(keys) > 30


@pytest.mark.parametrize("bad", ["inf", "-inf", "nan"])
@pytest.mark.parametrize(("key", "shape"), FLOAT_KEYS, ids=[k for k, _ in FLOAT_KEYS])
def test_every_float_key_refuses_inf_and_nan_naming_the_key(key: str, shape: str, bad: str
                                                            ) -> None:
    if "[]." in key:  # a key of a list of tables (rewards: `fn` is required)
        table, field = key.split("[].")
        override = f"{table}=[{{ fn = 'a.b:c', {field} = {bad} }}]"
        key = f"{table}.0.{field}"
    else:
        override = f"{key}={shape.format(x=bad)}"
    with pytest.raises(ConfigError, match=re.escape(key) + r"(\.\d)?: .*finite"):
        load_config(None, [override])


def test_inf_in_a_toml_file_is_refused_naming_the_key(tmp_path: Path) -> None:
    p = _write(tmp_path, "[scoring]\nreward_timeout_s = inf\n")
    with pytest.raises(ConfigError, match=r"scoring\.reward_timeout_s: .*finite"):
        load_config(p)


@pytest.mark.parametrize("name", ["..", ".", "../x", "a/b", "/abs", ".hidden", "-rf",
                                  "a\\b", "x/../y"])
def test_run_name_that_could_escape_a_directory_is_refused(name: str) -> None:
    with pytest.raises(ConfigError, match=r"run\.name"):
        load_config(None, [f"run.name={name!r}"])


@pytest.mark.parametrize("name", ["copy", "run.2", "a_b-c", "v1.0", "_x", "7"])
def test_ordinary_run_names_are_accepted(name: str) -> None:
    assert load_config(None, [f"run.name={name!r}"]).run.name == name
