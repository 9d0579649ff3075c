"""Exact resume with DataLoader workers: a run stopped after step k and resumed equals the uninterrupted run bit
for bit, with random augmentation decoded in 2 worker processes (issue 17 item 6)."""
import numpy as np
import pytest
import torch
from PIL import Image

from zoo.data.images import image_folder_datasets, train_transform
from zoo.data.seeding import SeededSamples
from zoo.train import Task, TrainConfig, Trainer
from zoo.train.distributed import DistContext

CPU = DistContext("none", torch.device("cpu"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A 3-class ImageFolder of 12 small PNGs of two sizes, decoded lazily by the workers."""
    root = tmp_path_factory.mktemp("photos")
    g = np.random.default_rng(0)
    for i in range(12):
        (root / f"c{i % 3}").mkdir(exist_ok=True)
        size = (40, 36) if i % 2 else (36, 44)
        Image.fromarray(g.integers(0, 256, (*size, 3), dtype=np.uint8)).save(root / f"c{i % 3}" / f"{i}.png")
    return root


def effnet_task(train):
    """A 50k-parameter EfficientNetV2 (b0's six stages, narrow, one block each; drop path draws in the loop)
    trained on `train` (uint8 images, labels 0..2) with the image folders' training augmentation:
    random-resized-crop, flip, TrivialAugment."""
    import zoo
    torch.manual_seed(0)
    model = zoo.load("effnetv2_cls", num_classes=3, drop_path_rate=0.2, widths=(8, 8, 16, 16, 24, 32, 32, 64),
                     depths=(1, 1, 1, 1, 1, 1))
    transform = train_transform(32, small=False, augment="trivial", mean=[0.5] * 3, std=[0.25] * 3)
    train.transform = transform
    return Task(name="effnetv2_cls", model=model, train_data=train, eval_data=None,
                loss=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
                eval_step=lambda m, b: {}, summarize=lambda s: {}, class_dim=-1)


def trained(folder, out, workers, *, resume_from=None, **flags):
    cfg = TrainConfig(steps=4, warmup=1, batch_size=4, workers=workers, log_every=1, out=str(out), **flags)
    trainer = Trainer(cfg, effnet_task(image_folder_datasets(folder, val_fraction=0)[0]), CPU)
    if resume_from is not None:
        trainer.load_checkpoint(resume_from)
    trainer.fit()
    return [p.detach().clone() for p in trainer.plain.state_dict().values()]


def test_resume_with_two_workers_is_bit_exact_and_workers_do_not_change_the_data(folder, tmp_path):
    # 12 images make 3 batches of 4: the 4 steps cross an epoch, and the stop after step 2 is mid-epoch
    straight = trained(folder, tmp_path, workers=2, save_every=2)
    # the same run stopped after step 2: resumed from that checkpoint by a new trainer with new workers
    resumed = trained(folder, tmp_path, workers=2, resume="auto", resume_from=tmp_path / "ckpt-00000002")
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)
    in_process = trained(folder, tmp_path / "in_process", workers=0)  # the same augmentation, drawn here
    for a, b in zip(straight, in_process):
        assert torch.equal(a, b)


class Noisy(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.rand(()) + i


def test_seeded_samples_leave_the_callers_random_state_alone():
    data = SeededSamples(Noisy(), seed=0)
    torch.manual_seed(1)
    before = torch.get_rng_state()
    first = data.__getitems__([(0, 1), (0, 2)])
    assert torch.equal(torch.get_rng_state(), before)
    assert data.__getitems__([(0, 2)])[0] == first[1]  # the sample's own draw, wherever it is read
    assert data[(1, 2)] != first[1]  # another epoch, another draw
