"""taps.drafters.load_drafter: a drafter folder of any layout loads as the drafter kind it holds.

1. The shipped heads (EAGLE-2, HASS, EAGLE-3) load as their kind with the weights their own
   ``from_pretrained`` gives, and the shipped target (a Hugging Face causal LM) as a ModelDrafter.
2. Small checkpoints written here: each kind in each weight file (model.safetensors, pytorch_model.bin),
   a head whose weight names carry a ``model.`` prefix, a sharded causal LM; bound to the target when one
   is given. A folder without config.json, or without weights, is refused.
"""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from taps import models  # noqa: E402
from taps.drafters import Eagle3Drafter, EagleDrafter, ModelDrafter, load_drafter  # noqa: E402
from taps.drafters.checkpoint import write_checkpoint  # noqa: E402

import engine_models as em  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("name, kind", [("eagle2-math", EagleDrafter), ("hass-chat", EagleDrafter),
                                        ("eagle3-mixed", Eagle3Drafter), ("eagle3-avg", Eagle3Drafter)])
def test_shipped_heads(name, kind):
    folder = models.models_dir() / "drafters" / name
    d = load_drafter(folder)
    assert type(d) is kind
    _same_weights(d, kind.from_pretrained(str(folder)))
    assert load_drafter(str(folder), dtype=torch.float32).fc.weight.dtype == torch.float32


def test_shipped_target_as_a_small_lm():
    d = load_drafter(models.models_dir() / "target")
    assert type(d) is ModelDrafter and d.vocab_size == json.loads(
        (models.models_dir() / "target" / "config.json").read_text())["vocab_size"]


def _heads(target):
    cfg = transformers.LlamaConfig(**{**target.config.to_dict(), "num_hidden_layers": 1})
    torch.manual_seed(1)
    eagle = em.randomize_(EagleDrafter(cfg), 0.2)
    eagle3 = em.randomize_(Eagle3Drafter(transformers.LlamaConfig(**{**cfg.to_dict(), "draft_vocab_size": 40})), 0.2)
    eagle3.set_vocab_mapping(torch.arange(0, 80, 2) - torch.arange(40))
    return eagle, eagle3


@pytest.mark.parametrize("safe", [True, False])
def test_written_checkpoints(tmp_path, safe):
    target = em.llama(80, 32, 3, seed=0)
    eagle, eagle3 = _heads(target)
    lm = em.llama(80, 16, 1, seed=2)
    eagle.save_pretrained(str(tmp_path / "eagle"), safe_serialization=safe)
    eagle3.save_pretrained(str(tmp_path / "eagle3"), safe_serialization=safe)
    lm.save_pretrained(str(tmp_path / "lm"), safe_serialization=safe)
    for folder, kind, weights in (("eagle", EagleDrafter, eagle), ("eagle3", Eagle3Drafter, eagle3),
                                  ("lm", ModelDrafter, lm)):
        d = load_drafter(tmp_path / folder)
        assert type(d) is kind, folder
        _same_weights(d.model if kind is ModelDrafter else d, weights)
        bound = load_drafter(tmp_path / folder, target=target)
        assert bound.vocab_size == 80
        if kind is not ModelDrafter:
            assert bound.embedding_weight() is target.get_input_embeddings().weight  # bound to the target


def test_prefixed_head_and_sharded_lm(tmp_path):
    target = em.llama(80, 32, 3, seed=0)
    eagle, _ = _heads(target)
    config = {**eagle.config.to_dict(), "bias": eagle.fc_bias}
    write_checkpoint(str(tmp_path / "prefixed"), config, {"model." + k: v for k, v in eagle.state_dict().items()})
    d = load_drafter(tmp_path / "prefixed")
    assert type(d) is EagleDrafter
    _same_weights(d, eagle)
    lm = em.llama(80, 32, 2, seed=3)
    lm.save_pretrained(str(tmp_path / "sharded"), max_shard_size="20KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    d = load_drafter(tmp_path / "sharded", dtype=torch.float32)
    assert type(d) is ModelDrafter
    _same_weights(d.model, lm)


def test_not_a_drafter_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_drafter(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no weights"):
        load_drafter(tmp_path)
