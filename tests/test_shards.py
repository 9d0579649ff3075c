"""WebDataset shards (issue 17 item 2): shards written by webdataset's own ShardWriter/TarWriter are indexed,
split across ranks and workers with each sample once per epoch, resumed exactly, and bad shards refused."""
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from zoo.data.shards import ShardImages, ShardIndex, ShardStream, TextShards, image_shards
from zoo.train import Task, TrainConfig, Trainer
from zoo.train.distributed import DistContext

from .test_train import torchrun
from .test_workers_resume import effnet_task

wds = pytest.importorskip("webdataset")
ROOT = Path(__file__).resolve().parents[1]
CPU = DistContext("none", torch.device("cpu"))


def png(g, h, w) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(g.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def write_image_shards(folder: Path, counts: list[int], name="train") -> str:
    """Shards of small PNGs of a few sizes, class = sample number % 3; returns their brace pattern."""
    folder.mkdir(parents=True, exist_ok=True)
    g, n = np.random.default_rng(0), 0
    for s, count in enumerate(counts):
        with wds.TarWriter(str(folder / f"{name}-{s:06d}.tar")) as sink:
            for _ in range(count):
                sink.write({"__key__": f"{name}{n:04d}", "png": png(g, 32 + n % 3 * 4, 36), "cls": n % 3})
                n += 1
    return str(folder / f"{name}-{{{0:06d}..{len(counts) - 1:06d}}}.tar")


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_image_shards(tmp_path_factory.mktemp("shards"), [8, 8])


def test_shard_writer_output_is_indexed_and_read_by_sample(tmp_path):
    g = np.random.default_rng(1)
    images = [png(g, 32, 32) for _ in range(5)]
    with wds.ShardWriter(str(tmp_path / "s-%06d.tar"), maxcount=2, verbose=0) as sink:
        for i, image in enumerate(images):
            sink.write({"__key__": f"k{i}", "png": image, "cls": 4 - i})
    data = ShardImages(ShardIndex(str(tmp_path / "s-{000000..000002}.tar"), ShardImages.FIELDS))
    assert [len(s.keys) for s in data.index.shards] == [2, 2, 1] and data.classes == 5
    for k in range(5):
        x, label = data[k]
        assert label == 4 - k and x.dtype == torch.uint8
        assert torch.equal(x, torch.from_numpy(np.array(Image.open(io.BytesIO(images[k])))).permute(2, 0, 1))


def test_each_sample_once_per_epoch_across_ranks(tmp_path):
    pattern = write_image_shards(tmp_path, [5, 4, 3])  # unequal: every rank yields as many as the fewest
    index = ShardIndex(pattern, ShardImages.FIELDS)
    streams = [ShardStream(range(len(index)), index, seed=0) for _ in range(2)]
    for rank, stream in enumerate(streams):
        stream.split(rank=rank, world_size=2, batch_size=2)
    assert len(streams[0]) == len(streams[1]) == 4  # rank 0 has shards 0 and 2 (8 samples), rank 1 shard 1 (4)
    for epoch in range(2):
        seen = []
        for stream in streams:
            stream.set_epoch(epoch)
            seen.append(list(stream))
        assert not set(seen[0]) & set(seen[1]) and all(len(set(s)) == len(s) == 4 for s in seen)
        assert set(seen[1]) == set(range(5, 9))  # shard 1 whole: each of its samples once
    first, second = (streams[0].order(e).tolist() for e in (0, 1))
    assert first != second  # another order, and other left-out samples, each epoch
    with pytest.raises(ValueError, match="3 shard\\(s\\) .* for 4 processes: each process reads whole shards"):
        streams[0].split(rank=0, world_size=4, batch_size=2)


def test_workers_take_the_batches_in_turn(tmp_path, monkeypatch):
    import zoo.data.shards
    index = ShardIndex(write_image_shards(tmp_path, [7, 4]), ShardImages.FIELDS)
    stream = ShardStream(range(len(index)), index, seed=0)
    stream.split(rank=0, world_size=1, batch_size=2)
    stream.set_epoch(1, skip=2)  # resumed after one batch
    alone = list(stream)
    assert alone == stream.order(1)[2:].tolist() and len(alone) == 8
    parts = []
    for worker in range(3):
        info = type("WorkerInfo", (), {"id": worker, "num_workers": 3})
        monkeypatch.setattr(zoo.data.shards, "get_worker_info", lambda info=info: info)
        parts.append(list(stream))
    # batch b after the skip from worker b % 3, as the DataLoader asks them in turn
    assert [parts[b % 3][b // 3 * 2:b // 3 * 2 + 2] for b in range(4)] == [alone[i:i + 2] for i in range(0, 8, 2)]


def test_resume_from_shards_with_two_workers_is_bit_exact(tmp_path):
    pattern = write_image_shards(tmp_path / "shards", [5, 3])

    def trained(workers, out, **flags):
        train, _, _ = image_shards(pattern)
        task = effnet_task(train)  # its model and augmentation, read through the stream
        task.train_data = ShardStream(train, train.index, seed=0)
        cfg = TrainConfig(steps=4, warmup=1, batch_size=4, workers=workers, log_every=1, out=str(tmp_path / out),
                          **flags)
        trainer = Trainer(cfg, task, CPU)
        if "resume" in flags:
            trainer.load_checkpoint(tmp_path / out / "ckpt-00000003")
        trainer.fit()
        return [p.detach().clone() for p in trainer.plain.state_dict().values()]
    # 8 samples make 2 batches an epoch: the stop after step 3 is in the second epoch, mid-way
    straight = trained(2, "run", save_every=3)
    resumed = trained(2, "run", save_every=3, resume="auto")
    in_process = trained(0, "in_process")  # the same order and augmentation without workers
    for a, b, c in zip(straight, resumed, in_process):
        assert torch.equal(a, b) and torch.equal(a, c)


RECORD = """
import os, runpy, sys
import zoo.data.shards as shards
seen, epoch, iterate, sample = sys.argv[1], [None], shards.ShardStream.__iter__, shards.ShardIndex.sample
def recording_iter(self):
    epoch[0] = self.epoch
    yield from iterate(self)
def recording_sample(self, k):
    s = sample(self, k)
    with open(os.path.join(seen, f"rank{os.environ['RANK']}-{os.getpid()}.txt"), "a") as f:
        f.write(f"{epoch[0]} {s['__key__']}\\n")
    return s
shards.ShardStream.__iter__, shards.ShardIndex.sample = recording_iter, recording_sample
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_effnet_trains_from_two_shards_under_torchrun_each_sample_once_per_epoch(shards, tmp_path):
    recorder, seen = tmp_path / "record.py", tmp_path / "seen"
    recorder.write_text(RECORD)
    seen.mkdir()
    torchrun(2, [str(seen), str(ROOT / "train_scripts" / "effnetv2_cls.py"), "--data", shards, "--dist", "ddp",
                 "--variant", "b0", "--epochs", "2", "--batch-size", "4", "--warmup", "1", "--workers", "2",
                 "--out", str(tmp_path / "run")], script=recorder)
    by_rank: dict[str, list[tuple[int, str]]] = {}
    for file in seen.glob("rank*.txt"):
        rank = file.name.split("-")[0]
        by_rank.setdefault(rank, []).extend((int(e), k) for e, k in map(str.split, file.read_text().splitlines()))
    assert sorted(by_rank) == ["rank0", "rank1"]
    everything = {f"train{n:04d}" for n in range(16)}
    for epoch in (0, 1):
        keys = [[k for e, k in by_rank[r] if e == epoch] for r in ("rank0", "rank1")]
        assert sorted(keys[0] + keys[1]) == sorted(everything)  # each sample once, none on both ranks
    replicas = json.loads((tmp_path / "run" / "replicas.json").read_text())
    assert replicas["world_size"] == 2  # 4 DDP steps ran, their replicas checked equal


def test_text_shards_read_as_a_table(tmp_path):
    with wds.TarWriter(str(tmp_path / "text-000000.tar")) as sink:
        for i, text in enumerate(["a fine day", "a dull night", "fair lord", "cold hall"]):
            sink.write({"__key__": f"t{i}", "txt": text, "cls": i % 2})
    table = TextShards(ShardIndex(str(tmp_path / "text-000000.tar"), TextShards.FIELDS))
    assert [table[i] for i in range(4)] == [("a fine day", "0"), ("a dull night", "1"), ("fair lord", "0"),
                                            ("cold hall", "1")]
    assert table.labels.problem() == "single_label" and table.labels.classes("single_label") == {"0", "1"}


def test_bert_cls_trains_from_text_shards(tmp_path):
    from .test_bert_tasks import PAIRS, train
    with wds.TarWriter(str(tmp_path / "text-000000.tar")) as sink:
        for i, (a, b) in enumerate(PAIRS * 3):
            sink.write({"__key__": f"t{i}", "txt": f"{a} {b}", "cls": i % 2})
    metrics = train(tmp_path, tmp_path / "text-000000.tar")
    assert sum(map(sum, metrics["confusion"])) == len(PAIRS) * 3  # evaluated on every sample of the shard


def write_tar(path: Path, members: dict[str, bytes], mode="w"):
    with tarfile.open(path, mode) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


@pytest.mark.parametrize("make,pattern,message", [
    (lambda d: None, "missing-{000000..000003}.tar", r"the shard pattern .* matches no file \(it names 4"),
    (lambda d: write_tar(d / "a-000000.tar", {"x.png": b"p"}), "a-{000000..000001}.tar",
     r"1 of the 2 shards of .* do not exist, e.g. .*a-000001.tar"),
    (lambda d: write_tar(d / "b.tar", {"0.png": b"p", "0.cls": b"1", "1.png": b"p"}), "b.tar",
     r"sample '1' has png but no label \(.cls\); each sample needs image and label"),
    (lambda d: write_tar(d / "c.tar", {"0.txt": b"t", "0.cls": b"1"}), "c.tar",
     r"sample '0' has cls, txt but no image \(.jpg or .jpeg or .png"),
    (lambda d: write_tar(d / "d.tar.gz", {"0.png": b"p", "0.cls": b"1"}, mode="w:gz"), "d.tar.gz",
     r"cannot be read as an uncompressed tar .*decompress them \(gunzip\)"),
    (lambda d: write_tar(d / "e.tar", {"0.png": b"p", "0.cls": b"cat"}), "e.tar",
     r"a .cls of .* holds 'cat'; it holds the class id, an integer >= 0"),
])
def test_bad_shards_are_refused_in_one_line(tmp_path, make, pattern, message):
    make(tmp_path)
    with pytest.raises((ValueError, FileNotFoundError), match=message) as e:
        ShardImages(ShardIndex(str(tmp_path / pattern), ShardImages.FIELDS))
    assert "\n" not in str(e.value)


def test_a_stream_without_the_stream_methods_is_refused(tmp_path):
    class Endless(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from ()
    task = Task(name="tiny", model=torch.nn.Linear(1, 1), train_data=Endless(), eval_data=None,
                loss=lambda m, b: m(b).sum(), eval_step=lambda m, b: {}, summarize=lambda s: {})
    with pytest.raises(ValueError, match="Endless has no split, set_epoch, __len__: zoo.train splits, counts"):
        Trainer(TrainConfig(steps=1, workers=0, out=str(tmp_path)), task, CPU)
