"""Config files, the `base:` chain, dotted overrides, and the errors for keys and values that do not fit."""

from pathlib import Path

import pytest
import yaml

from training.config import ConfigError, config_to_yaml, load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
BASES = ("imagenet256.yaml", "lightning.yaml", "modern.yaml", "digits.yaml", "shapes.yaml")
DIGITS_MODERN = "digits-modern.yaml"  # the digits on the modern recipe: studies.recipe_digits' modern arm
EXPERIMENTS = sorted(
    path
    for path in CONFIGS.glob("*.yaml")
    if path.name not in (*BASES, DIGITS_MODERN) and not path.name.startswith("lightning-")
)
LIGHTNING = sorted(CONFIGS.glob("lightning-*.yaml"))


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_one_config_per_paper_experiment():
    # DiT and SiT x S and B x patch 2/4/8 x VCA and MHSA, plus L/2 and XL/2 of both families and attentions.
    names = {path.stem for path in EXPERIMENTS}
    expected = {
        f"{family}-{size}{patch}-{attention}"
        for family in ("dit", "sit")
        for size in ("s", "b")
        for patch in (2, 4, 8)
        for attention in ("vca", "mhsa")
    }
    expected |= {
        f"{family}-{size}2-{attention}"
        for family in ("dit", "sit")
        for size in ("l", "xl")
        for attention in ("vca", "mhsa")
    }
    assert names == expected


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda path: path.stem)
def test_experiment_configs_share_the_paper_recipe(path):
    config = load_config(path)
    family, size_patch, attention = path.stem.split("-")
    assert config.model.name.lower().replace("/", "").replace("-", "") == family + size_patch
    assert config.model.attention == attention
    # The paper's recipe (docs/VCA.md), written once in imagenet256.yaml.
    train = config.train
    assert (train.global_batch_size, train.lr, train.weight_decay, train.ema_decay, train.max_steps) == (
        256,
        1e-4,
        0.0,
        0.9999,
        400_000,
    )
    assert train.warmup_steps == 0 and train.max_grad_norm is None and not train.ema_warmup
    assert (config.data.source, config.data.image_size, config.data.num_classes, config.data.random_flip) == (
        "latents",
        256,
        1000,
        True,
    )
    assert (config.vae.name, config.vae.scale) == ("stabilityai/sd-vae-ft-ema", 0.18215)
    assert config.run.dir == str(Path("results") / path.stem)
    # Each experiment file states only its base and its model: nothing of the recipe is repeated.
    assert set(
        line.split(":")[0] for line in path.read_text().splitlines() if line and not line.startswith((" ", "#"))
    ) == {"base", "model"}


@pytest.mark.parametrize("path", LIGHTNING, ids=lambda path: path.stem)
def test_lightning_configs_carry_lightning_dits_published_recipe(path):
    # hustvl/LightningDiT, configs/lightningdit_xl_vavae_f16d32.yaml (2725fed), read for these values.
    config = load_config(path)
    _, family, size_patch, attention = path.stem.split("-")
    assert config.model.name.lower().replace("/", "").replace("-", "") == family + size_patch
    assert (config.model.attention, config.model.blocks) == (attention, "lightning") and attention in ("mhsa", "vca")
    assert config.model.block_options == dict(norm="rmsnorm", mlp="swiglu", qk_norm=False, rope=True)
    train = config.train
    assert (train.global_batch_size, train.lr, train.betas, train.weight_decay, train.max_steps) == (
        1024,
        2e-4,
        [0.9, 0.95],
        0.0,
        80_000,
    )
    assert (train.ema_decay, train.warmup_steps, train.max_grad_norm) == (0.9999, 0, None)
    transport = config.transport
    assert (transport.path, transport.prediction, transport.time_distribution) == ("linear", "velocity", "logit-normal")
    assert (transport.logit_normal_location, transport.logit_normal_scale, transport.cosine_loss_weight) == (0, 1, 1)
    assert (config.vae.normalize, config.vae.scale) == ("channels", 1.0)  # latent_norm, latent_multiplier 1
    assert {line.split(":")[0] for line in path.read_text().splitlines() if line and line[0] not in " #"} == {
        "base",
        "model",
    }
    # every size of both families, each with both attentions: a VCA twin per MHSA file
    assert {p.stem for p in LIGHTNING} == {
        f"lightning-{family}-{size}2-{kind}"
        for family in ("dit", "sit")
        for size in ("s", "b", "l", "xl")
        for kind in ("mhsa", "vca")
    }


def test_block_options_resolve_from_the_preset_for_either_attention():
    mhsa = CONFIGS / "lightning-sit-b2-mhsa.yaml"
    assert load_config(mhsa, ["model.rope=false"]).model.block_options["rope"] is False  # a key beats the preset
    assert load_config(mhsa, ["model.blocks=dit", "model.mlp=swiglu"]).model.block_options == dict(
        norm="layernorm", mlp="swiglu", qk_norm=False, rope=False
    )
    # VCA takes the whole preset: QK-norm and RoPE apply inside its core
    vca = load_config(CONFIGS / "lightning-sit-b2-vca.yaml", ["model.blocks=lightning-qknorm"])
    assert vca.model.block_options == dict(norm="rmsnorm", mlp="swiglu", qk_norm=True, rope=True)


def test_the_block_preset_is_the_blocks_alone_and_the_modern_recipe_is_a_config():
    """model.blocks=lightning switches LightningDiT's blocks and nothing else (before the rename, model.recipe=lightning
    read as the whole recipe and gave its blocks on DDPM with beta2 0.999); modern.yaml is the whole recipe."""
    plain = load_config(CONFIGS / "digits.yaml")
    blocks = load_config(CONFIGS / "digits.yaml", ["model.blocks=lightning"])
    assert blocks.model.block_options == dict(norm="rmsnorm", mlp="swiglu", qk_norm=False, rope=True)
    assert (blocks.diffusion, blocks.transport, blocks.train) == (plain.diffusion, plain.transport, plain.train)
    modern = load_config(CONFIGS / DIGITS_MODERN)
    assert (modern.model.name, modern.model.blocks, modern.train.betas) == ("SiT-S/2", "lightning-qknorm", [0.9, 0.95])
    assert (modern.transport.time_distribution, modern.transport.cosine_loss_weight) == ("logit-normal", 1.0)
    assert (modern.train.lr, modern.train.max_steps, modern.data) == (plain.train.lr, plain.train.max_steps, plain.data)
    for name in (DIGITS_MODERN, "lightning.yaml"):  # both stand on modern.yaml: the recipe is written once
        assert "modern.yaml" in yaml.safe_load((CONFIGS / name).read_text())["base"]


def test_the_old_name_model_recipe_loads_as_model_blocks_with_one_line_once(tmp_path, capsys, monkeypatch):
    from training import config as config_module

    monkeypatch.setattr(config_module, "_told_renamed", set())
    old = write(tmp_path / "old.yaml", f"base: {CONFIGS / 'digits.yaml'}\nmodel:\n  recipe: lightning\n")
    config = load_config(old, ["model.recipe=lightning-qknorm"])  # the file and the command line: told once
    assert config.model.blocks == "lightning-qknorm"
    told = capsys.readouterr().err.strip().splitlines()
    assert len(told) == 1 and told[0].startswith(f"warning: {old}: 'model.recipe' is now 'model.blocks' (")
    load_config(old)
    assert capsys.readouterr().err == ""  # once per process
    with pytest.raises(ConfigError, match="'model.recipe' and 'model.blocks' are one key"):
        load_config(old, ["model.blocks=dit", "model.recipe=dit"])


@pytest.mark.parametrize(
    "key, decided_by",
    [("input_size", "data.image_size"), ("num_classes", "data.num_classes"), ("learn_sigma", "diffusion.learn_sigma")],
)
def test_the_model_settings_the_data_and_objective_decide_are_refused_in_a_config(key, decided_by):
    value = "true" if key == "learn_sigma" else "4"
    with pytest.raises(ConfigError, match=f"'model.{key}' is .*training sets it from {decided_by}.*leave it null"):
        load_config(CONFIGS / "digits.yaml", [f"model.{key}={value}"])


def test_a_checkpoint_written_before_a_key_existed_resumes_with_the_keys_default():
    import yaml

    from training.config import resume_conflict

    config = load_config(CONFIGS / "digits.yaml")
    saved = yaml.safe_load(config_to_yaml(config))
    del saved["model"]["blocks"], saved["model"]["rope"], saved["transport"]["cosine_loss_weight"]
    assert resume_conflict(config, yaml.safe_dump(saved)) is None
    lightning = load_config(CONFIGS / "digits.yaml", ["model.blocks=lightning", "model.attention=mhsa"])
    conflict = resume_conflict(lightning, yaml.safe_dump({**saved, "model": {**saved["model"], "attention": "mhsa"}}))
    assert conflict == ("model.blocks", "dit", "lightning")
    # A checkpoint's config.yaml written before the rename holds model.recipe: read under today's name.
    renamed = {**saved, "model": {**saved["model"], "recipe": "lightning", "attention": "mhsa"}}
    assert resume_conflict(lightning, yaml.safe_dump(renamed)) is None
    checkpointed = load_config(CONFIGS / "digits.yaml", ["model.gradient_checkpointing=true"])
    assert resume_conflict(checkpointed, yaml.safe_dump(saved)) is None  # the weights' values are the same


def test_digits_config_matches_the_calibration():
    config = load_config(CONFIGS / "digits.yaml")
    assert (config.model.hidden_size, config.model.depth, config.model.num_heads) == (128, 4, 4)
    assert config.model.attention == "vca" and config.model.name.endswith("/2")
    assert (config.data.source, config.data.image_size, config.data.num_classes) == ("digits", 8, 10)
    assert config.train.global_batch_size == 128 and config.train.warmup_steps == 200
    assert config.train.max_grad_norm == 1.0 and config.train.ema_decay == 0.999 and config.train.ema_warmup


def test_overrides_are_typed_and_win_over_files(tmp_path):
    base = write(tmp_path / "base.yaml", "train: {lr: 1.0e-4, betas: [0.9, 0.95]}\nlog: {every: 7}\n")
    child = write(tmp_path / "child.yaml", "base: base.yaml\nlog: {every: 9}\n")
    config = load_config(
        child,
        [
            "model.name=SiT-B/4",
            "data.source=digits",
            "data.image_size=8",
            "data.num_classes=10",
            "train.global_batch_size=32",
            "train.max_steps=5",
            "train.ema_decay=0.99",
            "train.lr=2e-4",
            "train.max_grad_norm=null",
        ],
    )
    assert config.train.lr == 2e-4 and isinstance(config.train.lr, float)  # "2e-4" parsed as a float
    assert config.train.betas == [0.9, 0.95]  # from the base
    assert config.log.every == 9  # the file overrides its base
    assert config.train.max_grad_norm is None
    assert config.run.dir == str(Path("results") / "child")
    assert base.exists()


def test_resolved_yaml_loads_back_to_the_same_config(tmp_path):
    config = load_config(CONFIGS / "sit-b2-vca.yaml", ["train.lr=3e-4", "run.dir=somewhere"])
    saved = write(tmp_path / "resolved.yaml", config_to_yaml(config))
    assert load_config(saved) == config


@pytest.mark.parametrize(
    "override, message",
    [
        (["train.lrr=1"], "unknown key 'train.lrr'; valid keys under 'train': global_batch_size"),
        (["trian.lr=1"], "unknown key 'trian'; valid keys at the top level: model, diffusion"),
        (["train.lr=fast"], "bad value for 'train.lr' (expected float)"),
        (["log.every=2.5"], "bad value for 'log.every' (expected int)"),
        (["train=3"], "'train' must be a section of keys"),
        (["model.attention=mha"], "'model.attention' is 'mha'; valid choices: vca, mhsa"),
        (["data.source=imagenet"], "valid choices: latents, images, digits, shapes"),
        (["model.name=DiT-M/2"], "'model.name' is 'DiT-M/2'; valid choices: DiT-S/1, DiT-S/2, DiT-S/4"),
        (["train.lr"], "is not of the form section.key=value"),
    ],
)
def test_bad_overrides_name_the_key_and_the_valid_choices(override, message):
    with pytest.raises(ConfigError) as error:
        load_config(CONFIGS / "dit-s2-vca.yaml", override)
    assert message in str(error.value)


def test_bad_file_values_name_the_file(tmp_path):
    bad = write(tmp_path / "bad.yaml", "base: " + str(CONFIGS / "imagenet256.yaml") + "\ntrain: {ema_decay: high}\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: bad value for 'train\.ema_decay' \(expected float\)"):
        load_config(bad)


def test_missing_required_values_are_listed(tmp_path):
    bare = write(tmp_path / "bare.yaml", "model: {name: DiT-S/2}\n")
    with pytest.raises(ConfigError, match="no value for data.image_size, data.num_classes, data.source"):
        load_config(bare)


def test_latent_space_needs_a_vae(tmp_path):
    no_vae = write(
        tmp_path / "no_vae.yaml",
        "base: " + str(CONFIGS / "imagenet256.yaml") + "\nmodel: {name: DiT-S/2}\nvae: {name: null}\n",
    )
    with pytest.raises(ConfigError, match="needs vae.name and vae.scale"):
        load_config(no_vae)


def test_base_chain_errors(tmp_path):
    write(tmp_path / "a.yaml", "base: b.yaml\n")
    write(tmp_path / "b.yaml", "base: a.yaml\n")
    with pytest.raises(ConfigError, match="circular `base:` chain"):
        load_config(tmp_path / "a.yaml")
    write(tmp_path / "c.yaml", "base: nowhere.yaml\n")
    with pytest.raises(ConfigError, match=r"nowhere\.yaml does not exist \(named as base by .*c\.yaml\)"):
        load_config(tmp_path / "c.yaml")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.ema_decay=1.5", "'train.ema_decay' is 1.5; expected a finite value >= 0 and <= 1"),
        ("train.betas=[0.9,1.5]", "'train.betas' is [0.9, 1.5]; expected a finite value >= 0 and <= 1"),
        ("train.lr=nan", "'train.lr' is nan; expected a finite value >= 0"),
        ("train.lr=inf", "'train.lr' is inf; expected a finite value >= 0"),
        ("train.warmup_steps=-1", "'train.warmup_steps' is -1; expected a finite value >= 0"),
        ("train.max_grad_norm=0", "'train.max_grad_norm' is 0.0; expected a finite value > 0"),
        ("data.num_workers=-1", "'data.num_workers' is -1; expected a finite value >= 0"),
        ("log.sample_every=-5", "'log.sample_every' is -5; expected a finite value >= 0"),
        ("log.export_every=-1", "'log.export_every' is -1; expected a finite value >= 0"),
        ("log.fid_samples=1", "'log.fid_samples' is 1; expected a finite value >= 2"),
        ("log.sample_count=0", "'log.sample_count' is 0; expected a finite value >= 1"),
        ("model.class_dropout_prob=-0.1", "'model.class_dropout_prob' is -0.1; expected a finite value >= 0 and <= 1"),
        ("vae.scale=0", "'vae.scale' is 0.0; expected a finite value > 0"),
    ],
)
def test_values_out_of_range_name_the_key_and_the_range(override, message):
    with pytest.raises(ConfigError) as error:
        load_config(CONFIGS / "dit-s2-vca.yaml", [override])
    assert message in str(error.value)


def test_zero_switches_off_what_it_documents():
    config = load_config(
        CONFIGS / "dit-s2-vca.yaml",
        [
            "log.sample_every=0",
            "log.fid_every=0",
            "log.export_every=0",
            "train.warmup_steps=0",
            "data.num_workers=0",
            "train.lr=0",
        ],
    )
    assert (config.log.sample_every, config.log.fid_every, config.log.export_every) == (0, 0, 0)


def test_malformed_yaml_is_one_line_with_the_place(tmp_path):
    bad = write(tmp_path / "bad.yaml", "train:\n  lr: 1\n\tema_decay: 2\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: not valid YAML \(.* at line 3, column 1\)$"):
        load_config(bad)


# ----------------------------------------------------------------------------------------------------------------
# train.py --help: every key of the schema, generated from the dataclasses
# ----------------------------------------------------------------------------------------------------------------


def schema_leaves(schema, prefix=""):
    """(dotted key, dataclasses.Field) of every leaf of the schema, walked here independently of the help code."""
    import dataclasses
    import typing

    leaves = []
    for item in dataclasses.fields(schema):
        field_type = typing.get_type_hints(schema)[item.name]
        if dataclasses.is_dataclass(field_type):
            leaves += schema_leaves(field_type, f"{prefix}{item.name}.")
        else:
            leaves.append((f"{prefix}{item.name}", item))
    return leaves


def test_train_help_lists_every_config_key_with_its_default_and_a_description(capsys):
    """Each key of training/config.py has one line `key=default  description`, whose default reads back (as YAML, the
    way an override is read) to the dataclass field's default; keys without a default say (required)."""
    import dataclasses
    import re

    import yaml
    from omegaconf import MISSING

    import train
    from training.config import Config

    with pytest.raises(SystemExit) as exit_:
        train.parse_arguments(["--help"])
    assert exit_.value.code == 0
    rows = {}
    listing = capsys.readouterr().out.partition("\nconfig keys (")[2]  # the epilog, after the options
    for line in listing.splitlines():
        if match := re.match(r"^  ([a-z_]+(?:\.[a-z_0-9]+)+)=(\S+)\s+(\S.*)$", line):
            rows[match.group(1)] = (match.group(2), match.group(3))
    leaves = schema_leaves(Config)
    assert set(rows) == {key for key, _ in leaves}
    for key, item in leaves:
        shown, description = rows[key]
        default = item.default_factory() if item.default_factory is not dataclasses.MISSING else item.default
        if default is MISSING or default is dataclasses.MISSING:  # ModelSpec.name: no default in Python either
            assert shown == "(required)", key
        else:
            assert yaml.safe_load(shown) == default, (key, shown, default)
        assert len(description) > 3, key


def test_a_new_key_is_listed_with_the_comment_beside_it():
    """The list is generated: a schema that gains a field (as a recipe change adds one) lists it, with its comment,
    a continuation line of the comment, its range and its default."""
    from dataclasses import dataclass, field

    from training.config_help import config_keys

    @dataclass
    class Section:
        """A section."""

        steps: int = field(default=3, metadata={"range": (1, 10, False)})  # how many steps
        mode: str = field(default="a", metadata={"choices": ("a", "b")})  # the mode, with a comment that
        # goes on below it
        plain: bool = True

    keys = {key.name: key for key in config_keys(Section, "new.")}
    assert list(keys) == ["new.steps", "new.mode", "new.plain"]
    assert keys["new.steps"].default == "3" and keys["new.steps"].description == "how many steps"
    assert keys["new.steps"].allowed == "a finite value >= 1 and <= 10"
    assert keys["new.mode"].description == "the mode, with a comment that goes on below it"
    assert keys["new.mode"].allowed == "one of a, b"
    assert keys["new.plain"].default == "true" and keys["new.plain"].description == ""


def test_the_objective_sections_offer_what_the_objectives_table_lists():
    """diffusion.* and transport.* take their choices and defaults from the objectives table, as the objectives'
    factories do (which dispatch on the same names): no choice is typed a second time in the schema."""
    import ast
    import dataclasses
    import inspect
    import textwrap

    from dit_vca.diffusion import create_diffusion
    from objectives import (
        DECODER_CDF,
        DIFFUSION,
        LOSS_WEIGHT,
        PATH,
        PREDICTION,
        TIME_DISTRIBUTION,
        DiffusionSpec,
        TransportSpec,
    )
    from sit_vca.transport import PATHS, create_transport

    table = {
        (DiffusionSpec, "decoder_cdf"): DECODER_CDF,
        (TransportSpec, "path"): PATH,
        (TransportSpec, "prediction"): PREDICTION,
        (TransportSpec, "loss_weight"): LOSS_WEIGHT,
        (TransportSpec, "time_distribution"): TIME_DISTRIBUTION,
    }
    for (schema, key), setting in table.items():
        (field,) = [field for field in dataclasses.fields(schema) if field.name == key]
        assert (field.default, field.metadata["choices"]) == (setting.default, setting.choices), key
    assert DiffusionSpec().learn_sigma is DIFFUSION.learn_sigma
    names = {choice for setting in table.values() for choice in setting.choices if isinstance(choice, str)}
    for schema in (DiffusionSpec, TransportSpec):
        tree = ast.parse(textwrap.dedent(inspect.getsource(schema)))
        typed = [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and node.value in names]
        assert not typed, f"{schema.__name__} types {typed} again instead of reading the objectives table"

    diffusion, transport = create_diffusion(), create_transport()
    assert (diffusion.spec.learn_sigma, diffusion.spec.decoder_cdf) == (DIFFUSION.learn_sigma, DECODER_CDF.default)
    assert isinstance(transport.path, PATHS[PATH.default]) and tuple(PATHS) == PATH.choices
    defaults = (transport.spec.prediction, transport.spec.loss_weight, transport.spec.time_distribution)
    assert defaults == (PREDICTION.default, LOSS_WEIGHT.default, TIME_DISTRIBUTION.default)
