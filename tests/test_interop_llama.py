"""transformer_lm loads LLaMA checkpoints written by transformers itself (random small configs, no network):
grouped-query attention, rope theta, tied and untied embeddings, rms_norm_eps; logits equal to
LlamaForCausalLM's, greedy generation equal to its generate(do_sample=False) token for token, the folder's
tokenizer.json for text, hf:// from an offline cache, the way back to LlamaForCausalLM, and the refusals."""
import json

import pytest
import torch

import zoo
from zoo.models.transformer import to_hf_config, to_hf_state_dict


transformers = pytest.importorskip("transformers")

VOCAB = 64
CONFIGS = {
    # 4 query heads sharing 2 key/value heads; rope theta and eps away from the defaults so a dropped value shows
    "gqa-tied": dict(num_key_value_heads=2, tie_word_embeddings=True, rope_theta=500.0, rms_norm_eps=1e-5),
    "gqa-untied": dict(num_key_value_heads=2, tie_word_embeddings=False, rope_theta=50000.0, rms_norm_eps=1e-6),
    "mqa-untied": dict(num_key_value_heads=1, tie_word_embeddings=False),
}


def hf_llama(seed: int = 0, **kw):
    torch.manual_seed(seed)
    # initializer_range 0.2 (not 0.02): logits of order 1, so a wrong rope layout or theta is far outside 1e-4
    config = transformers.LlamaConfig(**{**dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=56,
                                                num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                                                initializer_range=0.2, eos_token_id=None, bos_token_id=None,
                                                pad_token_id=None), **kw})
    return transformers.LlamaForCausalLM(config).eval()


def ids(batch=2, length=19, seed=1):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def assert_same_logits(model, hf, x=None):
    x = ids() if x is None else x
    with torch.no_grad():
        ours, theirs = model(x), hf(x).logits
    assert theirs.std() > 0.3, "the test's logits are too flat to tell conventions apart"
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", CONFIGS)
def test_llama_checkpoint_loads_with_equal_logits(name, tmp_path):
    hf = hf_llama(**CONFIGS[name])
    hf.save_pretrained(tmp_path)
    model = zoo.load("transformer_lm", pretrained=tmp_path)
    c, kw = model.config, CONFIGS[name]
    assert (c.n_kv_heads, c.tie_embeddings, c.context) == (kw["num_key_value_heads"], kw["tie_word_embeddings"], 64)
    assert c.rope_base == kw.get("rope_theta", 10000.0) and c.norm_eps == kw.get("rms_norm_eps", 1e-6)
    assert (model.lm_head.weight is model.embed.weight) == kw["tie_word_embeddings"]
    assert_same_logits(model, hf)


@pytest.mark.parametrize("name", ["gqa-tied", "gqa-untied"])
def test_greedy_generation_equals_transformers_token_for_token(name, tmp_path):
    hf = hf_llama(seed=3, **CONFIGS[name])
    hf.save_pretrained(tmp_path)
    model = zoo.load("transformer_lm", pretrained=tmp_path)
    prompt = ids(batch=1, length=6, seed=4)
    for use_cache in (True, False):
        ours = model.generate(prompt, 12, temperature=0, use_cache=use_cache)
        theirs = hf.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert ours.tolist() == theirs.tolist()
    assert len(set(ours[0, 6:].tolist())) > 2, "a degenerate continuation would prove little"


def test_llama_model_without_prefix_and_bin_file_load(tmp_path):
    hf = hf_llama(seed=5, **CONFIGS["gqa-tied"])
    hf.model.save_pretrained(tmp_path, safe_serialization=False)  # LlamaModel: no `model.`, no lm_head
    assert (tmp_path / "pytorch_model.bin").is_file() or (tmp_path / "model.safetensors").is_file()
    model = zoo.load("transformer_lm", pretrained=tmp_path)
    assert_same_logits(model, hf)


@pytest.mark.parametrize("name", ["gqa-tied", "gqa-untied"])
def test_round_trip_back_to_transformers(name, tmp_path):
    tied = CONFIGS[name]["tie_word_embeddings"]
    torch.manual_seed(6)
    model = zoo.load("transformer_lm", vocab_size=VOCAB, context=48, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                     mlp_hidden=40, dropout=0.0, rope_base=2000.0, norm_eps=1e-5, tie_embeddings=tied)
    for p in model.parameters():  # zoo's init is small too; logits of order 1 make the comparison bite
        if p.dim() == 2:
            torch.nn.init.normal_(p, 0.0, 0.2)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**to_hf_config(model.config))).eval()
    hf.load_state_dict(to_hf_state_dict(model), strict=True)
    assert_same_logits(model, hf)
    # and what transformers then writes loads back into zoo unchanged
    hf.save_pretrained(tmp_path)
    again = zoo.load("transformer_lm", pretrained=tmp_path)
    assert again.config == model.config
    for key, value in model.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key


def test_sliding_window_model_does_not_convert():
    model = zoo.load("transformer_lm", vocab_size=VOCAB, context=32, dim=32, n_layers=1, n_heads=4, window=8)
    with pytest.raises(ValueError, match="window=8"):
        to_hf_config(model.config)


def _tiny_tokenizer(vocab_size: int):
    """A WordLevel tokenizer over a few lines, with an unknown token: ids 0..vocab_size-1."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers
    tok = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    lines = ["the king is dead long live the king", "to be or not to be that is the question",
             "all the world is a stage and all the men and women merely players"]
    tok.train_from_iterator(lines, trainers.WordLevelTrainer(vocab_size=vocab_size, special_tokens=["[UNK]"]))
    assert tok.get_vocab_size() <= vocab_size
    return tok


@pytest.mark.parametrize("with_config", [False, True], ids=["tokenizer.json", "tokenizer_config.json"])
def test_folder_tokenizer_is_used_for_text(with_config, tmp_path):
    tok = _tiny_tokenizer(VOCAB)
    hf = hf_llama(seed=7, **CONFIGS["gqa-untied"], vocab_size=tok.get_vocab_size())  # every id decodes to a word
    hf.save_pretrained(tmp_path)
    if with_config:  # what save_pretrained of a transformers tokenizer writes
        transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path)
    else:  # only the tokenizers file
        tok.save(str(tmp_path / "tokenizer.json"))
    model = zoo.load("transformer_lm", pretrained=tmp_path)
    assert model.config.tokenizer == str(tmp_path.resolve())
    prompt = "to be or not"
    prompt_ids = tok.encode(prompt).ids
    assert model.tokenizer.encode(prompt) == prompt_ids
    text = model.generate(prompt, 8, temperature=0)
    theirs = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    assert text == tok.decode(theirs[0].tolist())
    # (decode drops special tokens, [UNK] here, as transformers' decode(skip_special_tokens=True) does)
    assert text.startswith(prompt) and len(text.split()) > 4


def test_zoo_save_of_a_llama_keeps_its_tokenizer(tmp_path):
    tok = _tiny_tokenizer(VOCAB)
    hf = hf_llama(seed=12, **CONFIGS["gqa-tied"], vocab_size=tok.get_vocab_size())
    hf.save_pretrained(tmp_path / "llama")
    tok.save(str(tmp_path / "llama" / "tokenizer.json"))
    model = zoo.load("transformer_lm", pretrained=tmp_path / "llama")
    zoo.save(model, tmp_path / "ours.safetensors")
    again = zoo.load("transformer_lm", pretrained=tmp_path / "ours.safetensors")
    assert again.config == model.config
    assert again.generate("the king", 5, temperature=0) == model.generate("the king", 5, temperature=0)


def test_hub_uri_offline_with_tokenizer(tmp_path, offline_hub):
    hf = hf_llama(seed=8, **CONFIGS["gqa-tied"])
    hf.save_pretrained(tmp_path / "saved", max_shard_size="20KB")  # sharded: model.safetensors.index.json
    assert (tmp_path / "saved" / "model.safetensors.index.json").is_file()
    tok = _tiny_tokenizer(VOCAB)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path / "saved")
    offline_hub.publish("someone/tiny-llama", tmp_path / "saved")
    model = zoo.load("transformer_lm", pretrained="hf://someone/tiny-llama")
    assert model.config.tokenizer == "someone/tiny-llama"  # portable: the repo id, not the cache path
    assert_same_logits(model, hf)
    assert model.tokenizer.encode("the king") == tok.encode("the king").ids


REFUSED = [
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),  # transformers 4.x layout
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}}, "rope_type='yarn'"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"mlp_bias": True}, "mlp_bias=True"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"head_dim": 16}, "head_dim=16"),
    ({"model_type": "mistral"}, "model_type='mistral'"),
]


@pytest.mark.parametrize("change, named", REFUSED, ids=[r[1] for r in REFUSED])
def test_what_does_not_fit_is_refused_naming_the_key(change, named, tmp_path):
    hf_llama(seed=9).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match="not supported by transformer_lm") as err:
        zoo.load("transformer_lm", pretrained=tmp_path)
    assert named in str(err.value)


def test_missing_and_extra_keys_are_named(tmp_path):
    hf = hf_llama(seed=10, **CONFIGS["gqa-untied"])
    hf.config.to_json_file(tmp_path / "config.json")
    sd = hf.state_dict()
    del sd["lm_head.weight"], sd["model.layers.1.mlp.up_proj.weight"]
    sd["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(32)
    torch.save(sd, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError) as err:
        zoo.load("transformer_lm", pretrained=tmp_path)
    message = str(err.value)
    for key in ("lm_head.weight", "model.layers.1.mlp.up_proj.weight", "model.layers.0.self_attn.q_proj.bias"):
        assert key in message
    assert "LlamaForCausalLM and LlamaModel" in message  # what would load instead


def test_llama_checkpoint_without_config_json_says_what_to_add(tmp_path):
    hf_llama(seed=11).save_pretrained(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(ValueError, match="config.json"):
        zoo.load("transformer_lm", pretrained=tmp_path)


@pytest.mark.parametrize("pad", [17, None], ids=["pad-17", "pad-is-eos"])
def test_greedy_generation_stops_at_eos_as_transformers_does(pad, tmp_path):
    """A batch of 2 where one row reaches EOS early: that row is padded (pad_token_id, else the EOS id) while the
    other runs on to max_new_tokens, token for token as transformers' generate; EOS comes from the checkpoint."""
    n = 10
    hf = hf_llama(seed=3, **CONFIGS["gqa-untied"])
    prompt = ids(batch=2, length=6, seed=4)
    free = hf.generate(prompt, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)[:, 6:]
    # EOS := the token row 0 first produces at some step 1 <= step < n - 2, one that row 1 never produces
    row0, row1 = free.tolist()
    step = next(k for k in range(1, n - 2) if row0[k] not in row1 + row0[:k])
    eos = row0[step]
    assert pad is None or pad not in prompt.tolist()  # else transformers would infer an attention mask from it
    for config in (hf.config, hf.generation_config):
        config.eos_token_id, config.pad_token_id = eos, pad
    hf.save_pretrained(tmp_path)
    theirs = hf.generate(prompt, max_new_tokens=n, do_sample=False)
    model = zoo.load("transformer_lm", pretrained=tmp_path)
    assert (model.config.eos_token_id, model.config.pad_token_id) == (eos, pad)
    for use_cache in (True, False):
        ours = model.generate(prompt, n, temperature=0, use_cache=use_cache)
        assert ours.tolist() == theirs.tolist()
    assert ours[0, 6 + step].item() == eos and ours[0, 6 + step + 1:].tolist() == [pad or eos] * (n - step - 1)
    assert ours.shape[1] == 6 + n and ours[1, 6:].tolist() == free[1].tolist()  # row 1 ran to the end
    # both rows finished: generation ends there (shorter than max_new_tokens), as transformers' does
    short = hf.generate(prompt[:1], max_new_tokens=n, do_sample=False)
    assert model.generate(prompt[:1], n, temperature=0).tolist() == short.tolist() and short.shape[1] == 6 + step + 1
    # eos_token_id=None turns the stop off
    assert model.generate(prompt, n, temperature=0, eos_token_id=None)[:, 6:].tolist() == free.tolist()


def test_generation_stops_at_the_tokenizer_eos_when_the_config_has_none(tmp_path):
    tok = _tiny_tokenizer(VOCAB)
    hf = hf_llama(seed=7, **CONFIGS["gqa-untied"], vocab_size=tok.get_vocab_size())
    hf.save_pretrained(tmp_path)
    prompt = "to be or not"
    free = zoo.load("transformer_lm", pretrained=tmp_path)  # no tokenizer yet: no EOS
    prompt_ids = torch.tensor([tok.encode(prompt).ids])
    continuation = free.generate(prompt_ids, 8, temperature=0, eos_token_id=None)[0, prompt_ids.shape[1]:].tolist()
    eos_id = next(t for k, t in enumerate(continuation) if k and t not in continuation[:k])
    eos_token = tok.id_to_token(eos_id)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]",
                                         eos_token=eos_token).save_pretrained(tmp_path)
    model = zoo.load("transformer_lm", pretrained=tmp_path)
    assert model.config.eos_token_id is None and model.tokenizer.hf.eos_token_id == eos_id
    out = model.generate(prompt_ids, 8, temperature=0)[0, prompt_ids.shape[1]:].tolist()
    assert out == continuation[:continuation.index(eos_id) + 1]
