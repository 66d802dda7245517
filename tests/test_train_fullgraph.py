"""`train.compile=true` compiles the model with fullgraph=True: a graph break is an error at the first step, never
a silent fall-back to several graphs with eager Python between them (which runs, slower, and hides the break)."""

from pathlib import Path

import pytest
import torch

from _tiny_runs import run_train
from dit_vca.models import DiT

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--config", str(ROOT / "configs" / "digits.yaml"), "model.hidden_size=32", "model.depth=1"]
TINY += ["model.num_heads=2", "train.global_batch_size=8", "train.max_steps=1", "log.sample_every=0"]


def test_a_graph_break_in_the_model_stops_a_compiled_run(tmp_path, monkeypatch):
    unpatchify = DiT.unpatchify

    def with_a_graph_break(self, x):
        torch._dynamo.graph_break()  # what an unsupported operation in the model would cause
        return unpatchify(self, x)

    monkeypatch.setattr(DiT, "unpatchify", with_a_graph_break)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="graph_break"):
        run_train(*TINY, "log.trackers=[]", "train.compile=true", f"run.dir={tmp_path / 'run'}")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_vca_compiles_whole_where_dynamo_cannot_trace_the_autocast_availability_query(monkeypatch):
    """Dynamo in torch 2.11 (the H200 machine's) cannot trace torch.amp.is_autocast_available: a compiled VCA model
    stopped at its first step there. Made untraceable here too (torch 2.14 traces it), the layer still compiles
    whole, as dit_vca.vca_core.autocast_exists is a constant to Dynamo."""
    from dit_vca.attention import VisualContrastAttention

    monkeypatch.setattr(torch.amp, "is_autocast_available", torch._dynamo.disable(torch.amp.is_autocast_available))
    torch._dynamo.reset()
    layer = VisualContrastAttention(32, 2, 4, 0)
    x = torch.randn(2, 16, 32)
    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = compiled(x)  # (2, 16, 32)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 16, 32)
