"""Volumes as users have them (issue 17 item 5): NIfTI read and written with nibabel's own Nifti1Image, the
prediction written back with the input's geometry; NIfTI pairs in a VolumeFolder read per item."""
import numpy as np
import pytest
import torch

import zoo
from zoo.data.volumes import VolumeFolder, read_volume

nibabel = pytest.importorskip("nibabel")
SHAPE = (20, 18, 16)  # no two sides equal: a transposed volume cannot pass


def oblique_affine() -> np.ndarray:
    """Voxels of 1.5 x 2 x 0.8 mm, rotated 30 degrees about z, shifted: a geometry an identity cannot fake."""
    c, s = np.cos(np.pi / 6), np.sin(np.pi / 6)
    rotation = np.array([[c, -s, 0], [s, c, 0], [0, 0, 1]])
    affine = np.eye(4)
    affine[:3, :3] = rotation @ np.diag([1.5, 2.0, 0.8])
    affine[:3, 3] = [-12.0, 40.5, 7.25]
    return affine


def nifti(path, data: np.ndarray) -> "nibabel.Nifti1Image":
    image = nibabel.Nifti1Image(data, oblique_affine())
    image.set_qform(oblique_affine(), code=1)  # scanner
    image.set_sform(oblique_affine(), code=2)  # aligned
    nibabel.save(image, str(path))
    return image


def test_zoo_predict_writes_labels_with_the_input_geometry(tmp_path):
    from zoo.cli import main
    volume = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)
    nifti(tmp_path / "in.nii.gz", volume)
    source = nibabel.load(str(tmp_path / "in.nii.gz"))  # the geometry as the file holds it (float32 rows)
    assert main(["predict", "unet3d_seg", str(tmp_path / "in.nii.gz"), "-o", str(tmp_path / "seg.nii.gz"),
                 "--window", "16"]) == 0
    out = nibabel.load(str(tmp_path / "seg.nii.gz"))
    np.testing.assert_array_equal(out.affine, source.affine)
    assert out.shape == SHAPE and out.get_data_dtype() == np.uint8
    assert out.header.get_zooms() == source.header.get_zooms()
    assert [int(out.header[k]) for k in ("qform_code", "sform_code")] == [1, 2]
    np.testing.assert_array_equal(out.get_qform(), source.get_qform())
    labels = np.asarray(out.dataobj)
    model = zoo.load("unet3d_seg", pretrained=True)
    assert labels.min() >= 0 and labels.max() < model.config.num_classes
    # voxel (i, j, k) of the output is the prediction for voxel (i, j, k) of the input: no axis moved
    want = model.predict_volume(torch.from_numpy(volume)[None], window=16).numpy()
    np.testing.assert_array_equal(labels, want)


def test_4d_nifti_channels_come_first_and_nifti_pairs_load_per_item(tmp_path):
    g = np.random.default_rng(1)
    four = g.standard_normal((*SHAPE, 2)).astype(np.float32)  # NIfTI's 4th axis: the channels
    nifti(tmp_path / "two.nii", four)
    array, image = read_volume(tmp_path / "two.nii")
    np.testing.assert_array_equal(array, np.moveaxis(four, -1, 0))
    np.testing.assert_allclose(image.affine, oblique_affine(), atol=1e-6)  # stored as float32
    label = g.integers(0, 3, SHAPE).astype(np.uint8)
    (tmp_path / "pairs").mkdir()
    nifti(tmp_path / "pairs" / "a.nii.gz", four[..., 0])
    nifti(tmp_path / "pairs" / "a_label.nii.gz", label)
    folder = VolumeFolder(tmp_path / "pairs")
    assert len(folder) == 1
    image, target = folder[0]
    assert image.shape == (1, *SHAPE) and torch.equal(image[0], torch.from_numpy(four[..., 0]))
    assert torch.equal(target, torch.from_numpy(label).long())
