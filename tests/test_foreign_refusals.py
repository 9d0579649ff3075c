"""Refusals of a checkpoint that does not fit name the keys (or config values) and say what would load instead:
the strict load of a bare state dict in another config, zoo-layout EfficientNetV2 keys of no variant's table, timm
weights whose shapes are not the architecture config.json names or no architecture zoo knows, and a BERT config
with another activation."""
import json

import pytest
import torch

import zoo


def test_bare_state_dict_of_another_config_names_keys_and_the_overrides_that_load_it(tmp_path):
    model = zoo.load("transformer_lm", vocab_size=64, context=16, dim=32, n_layers=1, n_heads=4, mlp_hidden=32)
    torch.save(model.state_dict(), tmp_path / "lm.pt")  # no metadata: the default config is assumed
    with pytest.raises(Exception) as err:
        zoo.load("transformer_lm", pretrained=tmp_path / "lm.pt")
    message = str(err.value)
    assert "embed.weight" in message and "blocks.1." in message  # mis-shaped and missing keys, named
    assert "zoo.save" in message and "overrides" in message  # what would load instead
    again = zoo.load("transformer_lm", pretrained=tmp_path / "lm.pt", vocab_size=64, context=16, dim=32,
                     n_layers=1, n_heads=4, mlp_hidden=32)
    assert torch.equal(again.embed.weight, model.embed.weight)


def test_zoo_effnetv2_keys_of_no_variant_table_are_named(tmp_path):
    model = zoo.load("effnetv2_cls", variant="b0", depths=(1, 1, 1, 1, 1, 1), num_classes=3)
    torch.save(model.state_dict(), tmp_path / "shallow.pt")
    with pytest.raises(ValueError, match="fits no variant") as err:
        zoo.load("effnetv2_cls", pretrained=tmp_path / "shallow.pt")
    message = str(err.value)
    missing_key = sorted(set(zoo.load("effnetv2_cls", variant="b0", num_classes=3).state_dict())
                         - set(model.state_dict()))[0]
    assert missing_key in message  # b0's first missing key, by name
    assert "zoo.save" in message  # what would load instead
    zoo.save(model, tmp_path / "shallow.safetensors")  # which does
    assert zoo.load("effnetv2_cls", pretrained=tmp_path / "shallow.safetensors").config.depths == (1,) * 6


def _timm_b0():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    return timm.create_model("tf_efficientnetv2_b0", pretrained=False).eval()


def test_timm_weights_config_json_names_another_architecture_says_which_fits(tmp_path):
    from safetensors.torch import save_file
    save_file(_timm_b0().state_dict(), tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"architecture": "tf_efficientnetv2_s", "num_classes": 1000}))
    with pytest.raises(ValueError, match="tf_efficientnetv2_s") as err:
        zoo.load("effnetv2_cls", pretrained=tmp_path)
    assert "conv_stem" in str(err.value) and "timm's tf_efficientnetv2_b0" in str(err.value)  # which would load


def test_timm_weights_of_unknown_depths_say_how_to_convert_them(tmp_path):
    sd = {k: v for k, v in _timm_b0().state_dict().items() if not k.startswith("blocks.5.7.")}  # one block fewer
    torch.save(sd, tmp_path / "cut.pth")
    with pytest.raises(ValueError, match="none of the timm architectures") as err:
        zoo.load("effnetv2_cls", pretrained=tmp_path / "cut.pth")
    assert "from_timm(state_dict, EffNetV2Config(widths=" in str(err.value)


def test_bert_config_with_another_activation_says_what_loads(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, hidden_act="relu")
    transformers.BertModel(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="hidden_act 'relu' is not supported") as err:
        zoo.load("bert_cls", pretrained=tmp_path)
    assert "hidden_act='gelu'" in str(err.value)
