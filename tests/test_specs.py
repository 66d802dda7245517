"""The model's and the objectives' settings, written once (issue 49): one spec each (dit_vca.model_spec.ModelSpec,
objectives.DiffusionSpec and TransportSpec) that is the config's section, the export's record and the one argument
the part is built from; and a reading of the project's source that fails where a list of a spec's settings is
written a second time (a signature, a schema, a dict or a call copying them over, a tuple of their names, a
constructor storing them one by one), as the network's were five times and the transport's three before."""

from __future__ import annotations

import ast
import dataclasses
import typing
from dataclasses import asdict, fields
from pathlib import Path

import pytest

from _import_graph import project_modules
from dit_vca.model_options import BLOCK_PRESETS, VCAOptions
from dit_vca.model_spec import IMAGENET_LATENTS, ModelSpec
from objectives import DiffusionSpec, TransportSpec, objective_from_record, objective_record

SPECS = (ModelSpec, DiffusionSpec, TransportSpec)


# ----------------------------------------------------------------------------------------------------------------
#                                   A second list of a spec's settings
# ----------------------------------------------------------------------------------------------------------------


def threshold(spec: type, copied: bool = False) -> int:
    """How many of a spec's settings make a list of them: more than half (all of DDPM's two) where the names are
    declared (a signature, a schema, a tuple, attributes), a third (at least two) where values are copied over
    under their own names, which is what a copy of the list does and a part that takes what it needs does not
    (a block takes its width, heads, MLP ratio, attention, norm and MLP, a third of the network's settings)."""
    return max(2, len(fields(spec)) // 3) if copied else len(fields(spec)) // 2 + 1


def _passes_on(key: str, value: ast.expr) -> bool:
    """`key=key`, `key=source.key` or `key=source["key"]`: a setting copied over under its own name."""
    if isinstance(value, ast.Name):
        return value.id == key
    if isinstance(value, ast.Attribute):
        return value.attr == key
    return isinstance(value, ast.Subscript) and isinstance(value.slice, ast.Constant) and value.slice.value == key


def second_lists(tree: ast.AST, spec: type) -> list[tuple[int, str]]:
    """(line, what) of every place in `tree` that spells a list of `spec`'s settings."""
    names, found = {item.name for item in fields(spec)}, []
    enough, copies = threshold(spec), threshold(spec, copied=True)
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            arguments = node.args
            parameters = {a.arg for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)}
            if len(parameters & names) >= enough:
                found.append((node.lineno, f"a signature: {sorted(parameters & names)}"))
            if not isinstance(node, ast.Lambda):
                stored = {
                    target.attr
                    for statement in ast.walk(node)
                    if isinstance(statement, ast.Assign | ast.AnnAssign)
                    for target in (statement.targets if isinstance(statement, ast.Assign) else [statement.target])
                    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                    if target.value.id == "self" and target.attr in names
                }
                if len(stored) >= enough:
                    found.append((node.lineno, f"attributes stored one by one: {sorted(stored)}"))
        elif isinstance(node, ast.ClassDef) and node.name != spec.__name__:
            declared = {
                item.target.id
                for item in node.body
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.target.id in names
            }
            if len(declared) >= enough:
                found.append((node.lineno, f"a schema {node.name}: {sorted(declared)}"))
        elif isinstance(node, ast.Call):
            copied = {word.arg for word in node.keywords if word.arg in names and _passes_on(word.arg, word.value)}
            if len(copied) >= copies:
                found.append((node.lineno, f"a call copying {sorted(copied)}"))
        elif isinstance(node, ast.Dict):
            copied = {
                key.value
                for key, value in zip(node.keys, node.values)
                if isinstance(key, ast.Constant) and key.value in names and _passes_on(key.value, value)
            }
            if len(copied) >= copies:
                found.append((node.lineno, f"a dict copying {sorted(copied)}"))
        elif isinstance(node, ast.Tuple | ast.List | ast.Set):
            named = {
                item.value.rsplit(".", 1)[-1]
                for item in node.elts
                if isinstance(item, ast.Constant) and isinstance(item.value, str)
                if item.value.rsplit(".", 1)[-1] in names
            }
            if len(named) >= enough:
                found.append((node.lineno, f"a tuple of their names: {sorted(named)}"))
    return found


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: spec.__name__)
def test_no_module_spells_a_specs_settings_a_second_time(spec):
    spellings = [
        f"{path.relative_to(path.parents[len(name.split('.')) - 1])}:{line}: {what}"
        for name, path in sorted(project_modules().items())
        for line, what in second_lists(ast.parse(path.read_text(), str(path)), spec)
    ]
    assert not spellings, f"{spec.__name__}'s settings written again (read them from the spec):\n" + "\n".join(
        spellings
    )


# What the reading must catch: each way the settings were spelled again before the specs (3b1f189), in small, each
# with as many of the transport's settings as make a list.
SPELLINGS = {
    "a signature": lambda names: f"def create({', '.join(names)}): ...",
    "attributes stored one by one": lambda names: (
        "class T:\n    def __init__(self, spec):\n" + "".join(f"        self.{name} = spec.{name}\n" for name in names)
    ),
    "a schema": lambda names: "class Config:\n" + "".join(f"    {name}: int = 0\n" for name in names),
    "a call copying": lambda names: f"make({', '.join(f'{name}=t.{name}' for name in names)})",
    "a dict copying": lambda names: "{" + ", ".join(f'"{name}": t["{name}"]' for name in names) + "}",
    "a tuple of their names": lambda names: "FIXED = (" + ", ".join(f'"transport.{name}"' for name in names) + ")",
}


@pytest.mark.parametrize("what", SPELLINGS)
def test_the_reading_finds_each_way_of_spelling_the_settings_again(what):
    names = [item.name for item in fields(TransportSpec)]
    enough = threshold(TransportSpec, copied=what.endswith("copying"))
    found = second_lists(ast.parse(SPELLINGS[what](names[:enough])), TransportSpec)
    assert len(found) == 1 and found[0][1].startswith(what), found
    # one setting fewer is a part taking what it needs, not a list
    assert second_lists(ast.parse(SPELLINGS[what](names[: enough - 1])), TransportSpec) == []


# ----------------------------------------------------------------------------------------------------------------
#                               One spec: config section, export record, argument
# ----------------------------------------------------------------------------------------------------------------


def test_each_spec_is_the_configs_section_and_the_exports_record():
    from generation.export import ExportDescription
    from training.config import Config

    sections = typing.get_type_hints(Config)
    assert (sections["model"], sections["diffusion"], sections["transport"]) == SPECS
    assert typing.get_type_hints(ExportDescription)["model"] is ModelSpec
    assert typing.get_args(typing.get_type_hints(ExportDescription)["objective"]) == (DiffusionSpec, TransportSpec)


def test_the_backbone_and_the_objectives_take_their_spec_as_their_one_argument():
    import torch

    from dit_vca.diffusion import GaussianDiffusion, linear_betas
    from dit_vca.models import DiT
    from sit_vca.transport import Transport

    spec = ModelSpec("SiT-S/2", depth=1, hidden_size=32, num_heads=2, input_size=8, in_channels=1, blocks="lightning")
    with torch.device("meta"):
        model = DiT(spec)
    assert model.spec == spec.resolved() and model.spec.rope and model.spec.learn_sigma is False
    transport = TransportSpec(path="vp", prediction="noise", time_distribution="logit-normal")
    assert Transport(transport).spec is transport and Transport(transport).train_eps == 1e-5  # VP's default
    diffusion = DiffusionSpec(learn_sigma=False, decoder_cdf="exact")
    assert GaussianDiffusion(linear_betas(1000), diffusion).respaced("50").spec is diffusion


def test_resolving_decides_every_setting_from_the_name_the_preset_and_the_family():
    resolved = ModelSpec("DiT-B/4", blocks="lightning-qknorm", mlp="gelu").resolved()
    assert (resolved.depth, resolved.hidden_size, resolved.num_heads, resolved.mlp_ratio) == (12, 768, 12, 4.0)
    assert resolved.block_options == {**BLOCK_PRESETS["lightning-qknorm"], "mlp": "gelu"}  # a setting beats its preset
    assert resolved.learn_sigma is True and ModelSpec("SiT-B/4").resolved().learn_sigma is False
    assert {key: getattr(resolved, key) for key in IMAGENET_LATENTS} == IMAGENET_LATENTS
    assert None not in asdict(resolved).values() and resolved.resolved() == resolved
    assert resolved.vca == VCAOptions() and resolved.patch_size == 4
    with pytest.raises(ValueError, match="unknown model name 'DiT-B/3'"):
        ModelSpec("DiT-B/3").resolved()


def test_records_of_earlier_layouts_read_as_specs():
    """The record layouts that earlier code wrote: the VCA switches at the top level (the first format), an MHSA
    model's section as null (formats 2 to 4), an objective naming its kind alone (official checkpoints)."""
    first = {"name": "DiT-S/2", "attention": "vca", "contrast_grid": 1, "joint_softmax": False, "depth": 1}
    assert ModelSpec.from_record(first).vca == VCAOptions(contrast_grid=1, joint_softmax=False)
    assert ModelSpec.from_record({"name": "DiT-S/2", "attention": "mhsa", "vca": None}).vca == VCAOptions()
    spec = ModelSpec("SiT-S/2", vca=VCAOptions(contrast_grid=2), blocks="lightning").resolved()
    assert ModelSpec.from_record(asdict(spec)) == spec
    assert objective_from_record({"kind": "transport"}) == TransportSpec()
    for objective in (DiffusionSpec(learn_sigma=False), TransportSpec(path="gvp", cosine_loss_weight=0.5)):
        assert objective_from_record(objective_record(objective)) == objective
    with pytest.raises(TypeError):  # an unknown setting is not dropped silently (an export reads it as damaged)
        ModelSpec.from_record({"name": "DiT-S/2", "no_such_setting": 1})


def test_the_fields_that_training_decides_are_left_null_by_the_config_and_set_by_build_model():
    from training.build import build_model
    from training.config import load_config

    decided = [item.name for item in fields(ModelSpec) if "decided_by" in item.metadata]
    assert decided == ["input_size", "in_channels", "num_classes", "learn_sigma"]
    config = load_config(Path(__file__).resolve().parents[1] / "configs" / "digits.yaml", ["model.depth=1"])
    assert [getattr(config.model, key) for key in decided] == [None] * 4
    model = build_model(config, in_channels=1, input_size=8)
    assert [getattr(model.spec, key) for key in decided] == [8, 1, 10, False]  # digits: DDPM without learn_sigma
    assert dataclasses.replace(model.spec, **dict.fromkeys(decided)) == dataclasses.replace(
        config.model.resolved(), **dict.fromkeys(decided)
    )
