"""--qat int8: quantization-aware training in zoo.train (PT2E fake quantization, fp32 weights shipped)."""
import pytest
import torch
from torch.utils.data import TensorDataset

import zoo
from zoo.train import Task, TrainConfig, Trainer
from zoo.train.distributed import DistContext

from .test_train_features import small_effnet

CPU = DistContext("none", torch.device("cpu"))


def image_task():
    """small_effnet (convolutions, BatchNorm, drop path 0.2 in its config) on 16 random 32x32 images."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 3, (16,), generator=g)
    model = small_effnet()

    def eval_step(m, b):
        logits = m(b[0])
        return {"correct": (logits.argmax(1) == b[1]).sum(), "logit_sum": logits.double().sum()}
    # eval batches of 6 (the last of 4): other sizes than the traced batch of 4
    return Task(name="effnetv2_cls", model=model, train_data=TensorDataset(x, y), eval_data=TensorDataset(x[:10], y[:10]),
                loss=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]), eval_step=eval_step,
                summarize=lambda s: {"top1": float(s["correct"]) / 10, "logit_sum": float(s["logit_sum"])},
                eval_batch_size=6, class_dim=-1, meta={"labels": ["a", "b", "c"]})


def qat_trainer(out, task=None, **flags):
    options = dict(steps=2, qat="int8", warmup=1, lr=1e-2, batch_size=4, workers=0, eval_every=1, save_every=1,
                   keep=5, out=str(out))
    torch.manual_seed(0)
    return Trainer(TrainConfig(**{**options, **flags}), task or image_task(), CPU)


def test_qat_effnet_trains_int8_static_and_resumes_exactly(tmp_path):
    task = image_task()
    loaded = {k: v.clone() for k, v in task.model.state_dict().items()}
    full = qat_trainer(tmp_path / "run", task)
    assert full.qat.method == "int8_static"
    # setting up observes the first batch as training does, and leaves the BatchNorm statistics as loaded
    for k, v in full.plain.state_dict().items():
        torch.testing.assert_close(v, loaded[k], rtol=0, atol=0, msg=k)
    quantizers = [k for k in full.model.state_dict() if k.endswith(".scale")]
    assert len(quantizers) > 20  # weights and activations of every convolution are fake-quantized
    full.fit()
    # evaluation runs the fake-quantized graph with BatchNorm on its running statistics: it changes no state
    final = {k: v.clone() for k, v in full.model.state_dict().items()}
    fake_int8 = full.evaluate()
    for k, v in full.model.state_dict().items():
        torch.testing.assert_close(v, final[k], rtol=0, atol=0, msg=k)
    path = full.save_final(fake_int8)

    # back to the checkpoint of step 1 (read from disk) and on: the same weights, BatchNorm statistics and
    # fake quantizer state (observed ranges, scales) as the uninterrupted run, bit for bit
    full.load_checkpoint(tmp_path / "run" / "ckpt-00000001")
    assert full.step == 1
    full.fit()
    for k, v in full.model.state_dict().items():
        torch.testing.assert_close(v, final[k], rtol=0, atol=0, msg=k)
    # the checkpoints hold the fake quantizers' state: a run without --qat does not take them
    with pytest.raises(ValueError, match="saved by a run with --qat int8: resume it with --qat int8"):
        qat_trainer(tmp_path / "run", qat=None, resume="auto").load_checkpoint(tmp_path / "run" / "ckpt-00000001")

    # the shipped file is a plain fp32 zoo model with the trained weights, saying what it was trained for
    model = zoo.load("effnetv2_cls", pretrained=path).eval()
    assert (model.pretrained_meta.extra["qat"], model.pretrained_meta.extra["qat_method"]) == ("int8", "int8_static")
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, final[f"graph.{k}"], rtol=0, atol=0, msg=k)
    # fake quantization is in the evaluated path: fp32 inference of the same weights gives other logits
    x = torch.randn(6, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        fp32, fake = model(x), full.model.eval()(x)
    assert not torch.equal(fp32, fake)
    torch.testing.assert_close(fake, fp32, rtol=0, atol=0.2 * float(fp32.abs().max()))


def text_task(vocab=1100):
    """A tiny bert_cls called as the train script calls it, m(ids, mask, types); eval batches are shorter."""
    torch.manual_seed(0)
    model = zoo.load("bert_cls", layers=1, hidden=32, heads=2, intermediate=64, max_positions=24, num_classes=2,
                     vocab_size=vocab)
    g = torch.Generator().manual_seed(0)

    def rows(n, length):
        ids = torch.randint(5, vocab, (n, length), generator=g)
        mask = torch.ones_like(ids)
        mask[::2, length - 3:] = 0  # padded rows
        return ids, mask, torch.zeros_like(ids), torch.randint(0, 2, (n,), generator=g)

    def eval_step(m, b):
        return {"correct": (m(*b[:3]).argmax(-1) == b[3]).sum(), "n": torch.tensor(len(b[3]))}
    return Task(name="bert_cls", model=model, train_data=TensorDataset(*rows(8, 12)),
                eval_data=TensorDataset(*rows(5, 7)),
                loss=lambda m, b: torch.nn.functional.cross_entropy(m(*b[:3]), b[3]), eval_step=eval_step,
                summarize=lambda s: {"accuracy": float(s["correct"] / s["n"])}, class_dim=-1)


def test_qat_bert_trains_dynamic_int8_resumes_in_a_new_trainer_and_exports(tmp_path):
    full = qat_trainer(tmp_path / "run", text_task())
    assert full.qat.method == "int8_dynamic"
    metrics = full.fit()  # evaluated on 5 rows of 7 tokens: the graph traced on 4 x 12 takes other sizes
    path = full.save_final(metrics)
    # a new trainer (its own trace of the model) resumes the checkpoint of step 1 exactly
    resumed = qat_trainer(tmp_path / "run", text_task(), resume="auto")
    resumed.load_checkpoint(tmp_path / "run" / "ckpt-00000001")
    resumed.fit()
    want, got = full.model.state_dict(), resumed.model.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=k)
    # the saved fp32 weights export, and quantize with the method they were trained for
    model = zoo.load("bert_cls", pretrained=path).eval()
    assert model.pretrained_meta.extra["qat_method"] == "int8_dynamic"
    exported = zoo.accel.export(model, format="pt2", out=tmp_path / "pt2", progress=False)
    assert exported.max_rel_error < 1e-3
    ids = torch.randint(5, 1100, (3, 9), generator=torch.Generator().manual_seed(2))
    q = zoo.accel.quantize(model, "int8_dynamic", backend="torchao")
    with torch.no_grad():
        assert q(ids, torch.ones_like(ids)).argmax(-1).shape == (3,)


@pytest.mark.parametrize("flags,message", [
    (dict(amp="bf16"), "--qat trains in fp32"),
    (dict(unfreeze="head@0,all@2"), "drop one of them"),
    (dict(eval_only=True), "--qat is a way to train"),
    (dict(batch_size=1), "use --batch-size 2 or more"),
    (dict(qat="int4"), "--qat must be one of int8"),
])
def test_qat_refuses_what_it_cannot_train_in_one_line(flags, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**{"steps": 1, "qat": "int8", **flags})

